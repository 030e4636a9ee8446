"""qwen35: a small serving engine for the dense Qwen3.5 models."""
