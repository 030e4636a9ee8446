"""The README's first command works on a fresh machine: the demo model is built on first use; the
command line's mistakes end in one line and exit status 2."""
import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=300)


def _one_line_error(out: subprocess.CompletedProcess, needle: str) -> None:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and needle in lines[0], out.stderr


def test_cli_mistakes_are_one_line(tiny_dir):
    _one_line_error(_cli("serve", "/no/such/dir"), "qwen35 serve: error: /no/such/dir: no such directory")
    _one_line_error(_cli("generate", "hi", str(tiny_dir), "--device", "cpu", "--max-tokens", "100000"),
                    "maximum context length")
    if importlib.util.find_spec("cupy") is None:
        _one_line_error(_cli("generate", "hi", str(tiny_dir), "--device", "cuda"), "pip install -e '.[cuda13]'")


def test_serve_binds_the_port_before_loading_the_model(tmp_path):
    """A port in use fails first: the checkpoint here would fail to load, but is never read."""
    (tmp_path / "config.json").write_text("{}")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _cli("serve", str(tmp_path), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu")
    _one_line_error(out, f"cannot listen on 127.0.0.1:{port}: Address already in use")


def test_help_shows_defaults():
    text = " ".join(_cli("serve", "--help").stdout.split())
    for default in ("--port PORT bind port (default: 8000)", "(default: 32)", "(default: 0.9)",
                    f"(default: {8 << 20})"):
        assert default in text, text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_engine_imports_nothing_above_it():
    """engine/ is the bottom layer: the command line (server/cli.py) imports it, never the reverse."""
    for path in (ROOT / "engine").rglob("*.py"):
        assert not re.search(r"^\s*(from|import)\s+(server|tools)\b", path.read_text(), re.M), path
