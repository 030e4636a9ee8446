"""`qwen35 serve`: bind the port, load the model, then accept connections (uvicorn);
SIGINT/SIGTERM abort every running request, let the responses finish with finish_reason
"abort", and stop the engine."""
from __future__ import annotations

import logging
import socket
from pathlib import Path

import uvicorn

from engine.engine import Engine

from . import serving
from .app import ServerContext, build_app

GRACEFUL_TIMEOUT_S = 10  # backstop: aborted streams end within one engine step

log = logging.getLogger("qwen35.server")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ServerContext):
        super().__init__(config)
        self.ctx = ctx

    def handle_exit(self, sig, frame) -> None:
        serving.abort_running(self.ctx)
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal after shutdown; we have shut down cleanly, so exit 0.
        self._captured_signals.clear()


def model_names(model_dir: str, served_model_name: str | None) -> tuple[str, str]:
    """/v1/models (id, root). Without a served name both are the directory's base name, so the
    server's filesystem layout stays private; with one, root is the path, as vLLM's (a client on
    the same machine loads the tokenizer from it)."""
    if served_model_name:
        return served_model_name, str(model_dir)
    return (Path(model_dir).name,) * 2


def bind(host: str, port: int) -> socket.socket:
    """The listening address, taken before the model loads: a port in use fails at once. Connections
    are accepted only once uvicorn runs (the socket listens from then), so clients poll /health."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restarts reuse TIME_WAIT ports
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve(model_dir: str, sock: socket.socket, *, engine_args: dict, served_model_name: str | None = None,
          log_level: str = "info", **options) -> None:
    """Loads the model and serves on sock (from bind). options: ServerContext's (api_key,
    trust_request_chat_template, reasoning_parser, ...)."""
    host, port = sock.getsockname()[:2]
    engine = Engine(model_dir, **engine_args)
    try:
        ctx = ServerContext(engine, *model_names(model_dir, served_model_name), **options)
        config = uvicorn.Config(build_app(ctx), host=host, port=port, log_level=log_level, lifespan="off",
                                timeout_graceful_shutdown=GRACEFUL_TIMEOUT_S)
        log.info("serving %s as %r on http://%s:%d", model_dir, ctx.model_name, host, port)
        _Server(config, ctx).run(sockets=[sock])
    finally:
        engine.shutdown()
