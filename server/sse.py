"""Server-sent events in vLLM's byte format: `data: <compact JSON>\\n\\n`, ending with `data: [DONE]`."""
from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"


def event(obj: dict) -> bytes:
    # One space after "data:" (the newer bench strips exactly "data: "); compact, single-line JSON.
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
