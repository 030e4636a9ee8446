"""Benchmarks and tools. A package so that `qwen35 bench serve` imports bench_serving; every file
also runs as a script (python3 tools/bench_serving.py ...)."""
