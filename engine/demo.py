"""The built-in demo checkpoint: the random `tiny` model, built once into a cache folder."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from .checkpoint import make_model
from .config import cache_root


def demo_model_dir() -> Path:
    """Path of the demo checkpoint, writing it on first use (atomically, so that concurrent
    first runs never see half a checkpoint)."""
    target = cache_root() / "tiny-demo"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-demo-"))
    make_model(tmp, "tiny")
    try:
        tmp.rename(target)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return target
