"""`qwen35 serve`: load the model, then open the port (uvicorn); SIGINT/SIGTERM abort every
running request, let the responses finish with finish_reason "abort", and stop the engine."""
from __future__ import annotations

import logging

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


def serve(model_dir: str, *, host: str, port: int, served_model_name: str | None, api_key: str | None,
          engine_args: dict, log_level: str = "info") -> None:
    engine = Engine(model_dir, **engine_args)  # the model is loaded before the port opens
    try:
        ctx = ServerContext(engine, served_model_name or model_dir, model_dir, api_key=api_key)
        config = uvicorn.Config(build_app(ctx), host=host, port=port, log_level=log_level, lifespan="off",
                                timeout_graceful_shutdown=GRACEFUL_TIMEOUT_S)
        log.info("serving %s as %r on http://%s:%d", model_dir, ctx.model_name, host, port)
        _Server(config, ctx).run()
    finally:
        engine.shutdown()
