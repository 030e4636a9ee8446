"""The README's first command works on a fresh machine: the demo model is built on first use."""
import os
import subprocess
import sys


def test_generate_prints_8_tokens_from_the_demo_model(tmp_path):
    env = dict(os.environ, QWEN35_CACHE=str(tmp_path))
    cmd = [sys.executable, "-m", "server.cli", "generate", "hello", "--max-tokens", "8", "--device", "cpu",
           "--temperature", "0", "--ignore-eos"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "[8 tokens in" in out.stderr
    assert len(out.stdout.rstrip("\n")) > 0
    assert (tmp_path / "tiny-demo" / "config.json").is_file()
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert again.stdout == out.stdout  # greedy, and the cached demo model is reused


def test_make_model_command(tmp_path):
    out = subprocess.run([sys.executable, "-m", "server.cli", "make-model", str(tmp_path / "m"), "--preset", "tiny3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "m" / "tokenizer.json").is_file() and (tmp_path / "m" / "model.safetensors").is_file()


def test_bench_serve_command():
    out = subprocess.run([sys.executable, "-m", "server.cli", "bench", "serve", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage: qwen35 bench serve" in out.stdout and "--max-concurrency" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "server.cli", "bench", "latency"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode != 0 and "qwen35 bench serve" in bad.stderr
