import pytest

from engine.checkpoint import make_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="session")
def tiny3_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny3"), "tiny3")
