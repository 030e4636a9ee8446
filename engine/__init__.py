"""qwen35: a small serving engine for the dense Qwen3.5 models."""
# Lazy exports keep `import engine` cheap (no tokenizer or model code until used).
_EXPORTS = {"LLM": "llm", "SamplingParams": "sampling_params", "Engine": "engine", "EngineArgs": "config"}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
