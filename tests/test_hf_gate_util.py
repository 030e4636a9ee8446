"""hf_or_skip: without torch/transformers (or CUDA, when asked for) an HF gate skips, but with
QWEN35_REQUIRE_HF set it fails: CI and the GPU machine must not pass a gate that never ran."""
import sys
import types

import pytest

from hf_gate_util import hf_or_skip


@pytest.fixture(params=[False, True], ids=["optional", "required"])
def required(request, monkeypatch):
    if request.param:
        monkeypatch.setenv("QWEN35_REQUIRE_HF", "1")
    else:
        monkeypatch.delenv("QWEN35_REQUIRE_HF", raising=False)
    return request.param


def _outcome(required):
    return pytest.fail.Exception if required else pytest.skip.Exception


def test_missing_torch(monkeypatch, required):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(_outcome(required), match="needs torch and transformers"):
        hf_or_skip()


def test_torch_without_cuda(monkeypatch, required):
    torch = types.SimpleNamespace(__version__="2.13.0+cpu", cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace())
    assert hf_or_skip()[0] is torch  # the CPU gate runs
    with pytest.raises(_outcome(required), match="sees no CUDA device"):
        hf_or_skip(cuda=True)
