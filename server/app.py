"""The OpenAI-compatible Starlette app: routes, auth, request ids, cancellation, error mapping."""
from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from . import engine_io, serving
from .errors import APIError, bad_request
from .metrics import Metrics
from .protocol import GenRequest, chat_request, check_model, completion_request, field_, parse_json
from .reasoning import prompt_opens_thinking

VERSION = "0.1.0"
_OPEN_PATHS = {"/health", "/ping", "/metrics", "/version"}  # no API key needed (orchestration, scraping)


@dataclass
class ServerContext:
    engine: object                # engine.Engine, started
    model_name: str               # the served name: /v1/models id, the only accepted `model`
    model_root: str               # /v1/models root: where a client loads the tokenizer from
    api_key: str | None = None
    metrics: Metrics = None

    def __post_init__(self):
        self.jobs: set = set()    # serving.Job of every request in flight (for shutdown)
        self.metrics = self.metrics or Metrics(self.model_name)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.max_num_seqs = self.engine.args.max_num_seqs
        self.vocab_size = self.engine.cfg.vocab_size


# --- middleware (pure ASGI: a BaseHTTPMiddleware would hide http.disconnect from the handlers) ---


class AuthAndRequestId:
    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id")
        if self.api_key and scope["path"] not in _OPEN_PATHS and scope["method"] != "OPTIONS":
            if headers.get(b"authorization", b"") != b"Bearer " + self.api_key.encode():
                err = APIError(401, "Unauthorized: missing or wrong API key (Authorization: Bearer <key>)")
                return await err.response()(scope, receive, _echo_id(send, rid))
        await self.app(scope, receive, _echo_id(send, rid))


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


async def _cancellable(request: Request, coro):
    """Runs coro; a client disconnect cancels it (its finally aborts the engine requests)."""
    work = asyncio.ensure_future(coro)
    listener = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        work.cancel()  # no-op when done
        await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        return Response(status_code=499)  # nobody is listening any more
    return work.result()


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

        work = asyncio.ensure_future(body())
        listener = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            listener.cancel()
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            await self.gen.aclose()


# --- handlers ---


async def _body(request: Request) -> dict:
    return parse_json(await request.body())


def _truncate(g: GenRequest, ids: list[int]) -> list[int]:
    return ids[-g.truncate_prompt_tokens:] if g.truncate_prompt_tokens else ids


async def _respond(request: Request, ctx: ServerContext, job: serving.Job, thinking, as_json, as_stream):
    serving.submit(ctx, job, thinking)  # admission (503 on a full queue) before any header
    if job.g.stream:
        return EventStream(as_stream(ctx, job))
    try:
        return JSONResponse(await _cancellable(request, as_json(ctx, job)))
    finally:
        serving.abort_all(ctx, job)


async def completions(request: Request):
    ctx: ServerContext = request.app.state.ctx
    body = await _body(request)
    check_model(body, ctx.model_name)
    g, prompts = completion_request(body, vocab_size=ctx.vocab_size,
                                    max_model_len=ctx.max_model_len, max_n=ctx.max_num_seqs)
    tok = ctx.tokenizer
    ids = [_truncate(g, tok.encode(p) if isinstance(p, str) else list(p)) for p in prompts]
    texts = [p if isinstance(p, str) else tok.decode(p) for p in prompts] if g.echo else []
    job = serving.Job("cmpl-" + secrets.token_hex(16), g, ids, texts)
    return await _respond(request, ctx, job, None, serving.completion_json, serving.completion_stream)


def render_chat(ctx: ServerContext, messages: list[dict], opts: dict) -> str:
    tok = ctx.tokenizer
    if opts.get("chat_template"):
        tok = type(tok)(tok.backend, chat_template=opts["chat_template"], bos_token=tok.bos_token,
                        eos_token=tok.eos_token, pad_token=tok.pad_token, source="request chat_template")
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=opts["add_generation_prompt"],
                                       tools=opts.get("tools"), **opts["kwargs"])
    except Exception as e:  # noqa: BLE001 - template errors come from the request's messages
        raise bad_request(f"could not render the chat template: {e}", "messages") from None
    if opts.get("continue_final_message"):
        # Cut the rendered turn right after the last message's content, so the model continues it.
        last = (messages[-1].get("content") or "").strip()
        at = text.rfind(last) if last else -1
        if at >= 0:
            text = text[:at + len(last)]
    return text


async def chat_completions(request: Request):
    ctx: ServerContext = request.app.state.ctx
    body = await _body(request)
    check_model(body, ctx.model_name)
    g, messages, opts = chat_request(body, vocab_size=ctx.vocab_size,
                                     max_model_len=ctx.max_model_len, max_n=ctx.max_num_seqs)
    text = render_chat(ctx, messages, opts)
    ids = _truncate(g, ctx.tokenizer.encode(text))
    job = serving.Job("chatcmpl-" + secrets.token_hex(16), g, [ids], [])
    return await _respond(request, ctx, job, prompt_opens_thinking(text), serving.chat_json, serving.chat_stream)


async def models(request: Request):
    ctx: ServerContext = request.app.state.ctx
    card = {"id": ctx.model_name, "object": "model", "created": request.app.state.started, "owned_by": "vllm",
            "root": ctx.model_root, "parent": None, "max_model_len": ctx.max_model_len, "permission": []}
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
    body = await _body(request)
    check_model(body, ctx.model_name)
    if "messages" in body:
        _, messages, opts = chat_request(dict(body, stream=False), vocab_size=ctx.vocab_size,
                                         max_model_len=ctx.max_model_len, max_n=ctx.max_num_seqs)
        text = render_chat(ctx, messages, opts)
    else:
        text = field_(body, "prompt", str)
        if text is None:
            raise bad_request("'prompt' (a string) or 'messages' is required", "prompt")
    ids = ctx.tokenizer.encode(text, add_special_tokens=field_(body, "add_special_tokens", bool, default=True))
    strs = ctx.tokenizer.convert_ids_to_tokens(ids) if field_(body, "return_token_strs", bool, default=False) else None
    return JSONResponse({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs})


async def detokenize(request: Request):
    ctx: ServerContext = request.app.state.ctx
    body = await _body(request)
    check_model(body, ctx.model_name)
    ids = field_(body, "tokens", list)
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < ctx.vocab_size
                              for i in ids):
        raise bad_request(f"'tokens' must be a list of token ids in [0, {ctx.vocab_size})", "tokens")
    return JSONResponse({"prompt": ctx.tokenizer.decode(ids)})


async def _api_error(request: Request, exc: APIError):
    return exc.response()


async def _http_error(request: Request, exc: HTTPException):
    msg = f"Not Found: {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
    return APIError(exc.status_code, msg, headers=exc.headers).response()


async def _internal_error(request: Request, exc: Exception):
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()


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
