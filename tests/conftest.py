import pytest

from engine.checkpoint import make_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="session")
def tiny3_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny3"), "tiny3")


def gpu_or_skip():
    """CuPy with a usable device, or skip (a test, a fixture's users, or a whole module)."""
    cupy = pytest.importorskip("cupy")
    try:
        assert cupy.cuda.runtime.getDeviceCount() > 0
    except Exception as e:  # noqa: BLE001 - no driver, no device: skip, don't fail
        pytest.skip(f"no usable CUDA device ({e})", allow_module_level=True)
    return cupy


@pytest.fixture(scope="session")
def model_4b_dir(tmp_path_factory):
    """The random 4B checkpoint (about 40 s to write), or a real one from QWEN35_MODEL_4B."""
    import os
    return os.environ.get("QWEN35_MODEL_4B") or make_model(tmp_path_factory.mktemp("4b"), "4b")


@pytest.fixture(scope="module", params=[pytest.param("cpu", id="cpu-tiny"),
                                        pytest.param("cuda", id="gpu-4b", marks=pytest.mark.gpu)])
def target(request):
    """(model dir, device): the tiny model on the NumPy backend, and the 4B checkpoint on the GPU."""
    if request.param == "cuda":
        gpu_or_skip()
        return request.getfixturevalue("model_4b_dir"), "cuda"
    return request.getfixturevalue("tiny_dir"), "cpu"
