"""docs/api.md is true: every flag of `qwen35 serve --help` and every metric on /metrics is in it."""
import contextlib
import io
import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from engine.engine import Engine
from server.app import ServerContext, build_app
from server.cli import main

DOC = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()


def _in_doc(name: str) -> bool:
    return re.search(rf"(?<![\w:-]){re.escape(name)}(?![\w:-])", DOC) is not None


def test_every_serve_flag_is_documented():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["serve", "--help"])
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue()))
    assert len(flags) > 15 and "--trace-steps" in flags
    assert sorted(f for f in flags if not _in_doc(f)) == []


def test_every_metric_is_documented(tiny_dir):
    engine = Engine(tiny_dir, device="cpu", max_num_seqs=2, max_model_len=64)
    try:
        with TestClient(build_app(ServerContext(engine, "tiny", "tiny"))) as c:
            text = c.get("/metrics").text
    finally:
        engine.shutdown()
    names = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    assert len(names) > 10 and "qwen35:device_memory_used_bytes" in names
    assert sorted(n for n in names if not _in_doc(n)) == []
