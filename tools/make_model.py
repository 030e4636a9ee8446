"""Write a random-weight Qwen3.5 checkpoint: python tools/make_model.py OUT --preset 4b (same as `qwen35 make-model`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.checkpoint import main  # noqa: E402

if __name__ == "__main__":
    main()
