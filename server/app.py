"""The OpenAI-compatible Starlette app: routes, auth, request ids, the body size limit,
cancellation, error mapping.

Handlers only move bytes and events: each request's CPU work (parsing, the chat template,
tokenization) runs in a worker thread (prompts.py), so the event loop keeps every stream and
/health going whatever one request sends.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from . import engine_io, prompts, serving
from .errors import APIError
from .metrics import Metrics

VERSION = "0.1.0"
MAX_REQUEST_BODY_BYTES = 8 << 20  # JSON this big still parses in about 0.1 s
_OPEN_PATHS = {"/health", "/ping", "/metrics", "/version"}  # no API key needed (orchestration, scraping)

log = logging.getLogger("qwen35.server")


@dataclass
class ServerContext:
    engine: object                # engine.Engine, started
    model_name: str               # the served name: /v1/models id, the only accepted `model`
    model_root: str               # /v1/models root: where a client loads the tokenizer from
    api_key: str | None = None
    metrics: Metrics = None
    trust_request_chat_template: bool = False
    reasoning_parser: str | None = None  # None: no reasoning split (all output is content)
    max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES

    def __post_init__(self):
        self.jobs: set = set()    # serving.Job of every request in flight (for shutdown)
        self.metrics = self.metrics or Metrics(self.model_name)
        self.limits = engine_io.limits(self.engine)
        self.tokenizer = engine_io.tokenizer(self.engine)
        self.chars_per_token = prompts.chars_per_token(self.tokenizer)


# --- middleware (pure ASGI: a BaseHTTPMiddleware would hide http.disconnect from the handlers) ---


class AuthAndRequestId:
    def __init__(self, app, api_key: str | None):
        self.app = app
        self.key_digest = hashlib.sha256(b"Bearer " + api_key.encode()).digest() if api_key else None

    def authorized(self, authorization: bytes) -> bool:
        # Digests compared in constant time: neither the key's bytes nor its length leak by timing.
        return hmac.compare_digest(hashlib.sha256(authorization).digest(), self.key_digest)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id")
        if self.key_digest and scope["path"] not in _OPEN_PATHS and scope["method"] != "OPTIONS":
            if not self.authorized(headers.get(b"authorization", b"")):
                err = APIError(401, "Unauthorized: missing or wrong API key (Authorization: Bearer <key>)")
                return await err.response()(scope, receive, _echo_id(send, rid))
        try:
            await self.app(scope, receive, _echo_id(send, rid))
        except Exception:  # noqa: BLE001 - Starlette re-raises after its 500, which _internal_error logged
            pass


def _echo_id(send, rid: bytes | None):
    if rid is None:
        return send

    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = dict(message, headers=[*message.get("headers", []), (b"x-request-id", rid)])
        await send(message)
    return wrapped


# --- cancellation: race the work against http.disconnect, as vLLM's with_cancellation ---


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(receive, coro) -> asyncio.Future | None:
    """Runs coro until it ends or the client goes away, which cancels it (its finally aborts the
    engine requests). Returns the finished task, or None after a disconnect."""
    work = asyncio.ensure_future(coro)
    listener = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        work.cancel()  # no-op when done
        await asyncio.gather(work, listener, return_exceptions=True)
    return None if work.cancelled() else work


class EventStream:
    """An SSE response (ASGI app) whose generator is cancelled the moment the client goes away,
    even while nothing is being sent (prefill)."""

    HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

    def __init__(self, gen):
        self.gen = gen

    async def __call__(self, scope, receive, send):
        async def body():
            await send({"type": "http.response.start", "status": 200, "headers": self.HEADERS})
            async for chunk in self.gen:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await _unless_disconnected(receive, body())
        finally:
            await self.gen.aclose()


# --- handlers ---


async def _body(request: Request, limit: int) -> bytes:
    """The request body; past `limit` bytes a 413, without reading the rest."""
    def too_large(size: str) -> APIError:
        return APIError(413, f"The request body has {size} bytes; the limit is {limit} (--max-request-body-bytes).")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(f"more than {limit}")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the request") from None
    return b"".join(chunks)


async def _prepare(request: Request, ctx: ServerContext, work):
    """Reads the body, then runs work(ctx, body) in a worker thread (prompts.py)."""
    return await asyncio.to_thread(work, ctx, await _body(request, ctx.max_request_body_bytes))


async def _respond(request: Request, ctx: ServerContext, job: serving.Job, thinking, as_json, as_stream):
    await serving.submit(ctx, job, thinking)  # admission (503 on a full queue) before any header
    if job.g.stream:
        return EventStream(as_stream(ctx, job))
    try:
        work = await _unless_disconnected(request.receive, as_json(ctx, job))
    finally:
        serving.abort_all(ctx, job)
    return Response(status_code=499) if work is None else JSONResponse(work.result())  # 499: nobody listens


async def completions(request: Request):
    ctx: ServerContext = request.app.state.ctx
    g, ids, texts = await _prepare(request, ctx, prompts.completion)
    job = serving.Job("cmpl-" + secrets.token_hex(16), g, ids, texts)
    return await _respond(request, ctx, job, None, serving.completion_json, serving.completion_stream)


async def chat_completions(request: Request):
    ctx: ServerContext = request.app.state.ctx
    g, ids, opens_thinking = await _prepare(request, ctx, prompts.chat)
    job = serving.Job("chatcmpl-" + secrets.token_hex(16), g, [ids], [])
    thinking = opens_thinking if ctx.reasoning_parser else None
    return await _respond(request, ctx, job, thinking, serving.chat_json, serving.chat_stream)


async def models(request: Request):
    ctx: ServerContext = request.app.state.ctx
    card = {"id": ctx.model_name, "object": "model", "created": request.app.state.started, "owned_by": "vllm",
            "root": ctx.model_root, "parent": None, "max_model_len": ctx.limits.max_model_len, "permission": []}
    return JSONResponse({"object": "list", "data": [card]})


async def health(request: Request):
    return Response(status_code=200 if engine_io.alive(request.app.state.ctx.engine) else 503)


async def metrics(request: Request):
    ctx: ServerContext = request.app.state.ctx
    return PlainTextResponse(ctx.metrics.render(engine_io.gauges(ctx.engine), engine_io.counters(ctx.engine)),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


async def version(request: Request):
    return JSONResponse({"version": VERSION})


async def tokenize(request: Request):
    ctx: ServerContext = request.app.state.ctx
    ids, strs = await _prepare(request, ctx, prompts.tokenize)
    return JSONResponse({"count": len(ids), "max_model_len": ctx.limits.max_model_len, "tokens": ids,
                         "token_strs": strs})


async def detokenize(request: Request):
    ctx: ServerContext = request.app.state.ctx
    return JSONResponse({"prompt": await _prepare(request, ctx, prompts.detokenize)})


async def _api_error(request: Request, exc: APIError):
    return exc.response()


async def _http_error(request: Request, exc: HTTPException):
    msg = f"Not Found: {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
    return APIError(exc.status_code, msg, headers=exc.headers).response()


async def _internal_error(request: Request, exc: Exception):
    # The details stay in the log, under an id the client sees.
    ref = request.headers.get("x-request-id") or secrets.token_hex(8)
    log.error("internal error on %s %s (request id %s)", request.method, request.url.path, ref, exc_info=exc)
    return APIError(500, f"Internal server error (request id {ref}).").response()


def build_app(ctx: ServerContext):
    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={APIError: _api_error, HTTPException: _http_error,
                                                      Exception: _internal_error})
    app.state.ctx = ctx
    app.state.started = int(time.time())
    return AuthAndRequestId(app, ctx.api_key)
