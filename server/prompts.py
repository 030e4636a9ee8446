"""Request bodies to prompt token ids (and back, /detokenize), in a worker thread: no request's
CPU work may stall the event loop (every stream, /health).

Parsing, validation, the chat template and tokenization all run here (the handlers call these
functions through `asyncio.to_thread`), and each big input is bounded before it costs much:
- a request's own chat template runs only with --trust-request-chat-template, and then under a
  time limit (a thread cannot be killed, so a trace function stops it between two lines);
- a text whose length alone proves it cannot fit is refused before it is tokenized: no token
  stands for more than `chars_per_token` characters;
- tokenization releases the GIL (`Tokenizer.encode`), so it runs beside the loop.
"""
from __future__ import annotations

import sys
import time

from .errors import bad_request
from .protocol import GenRequest, chat_request, check_model, completion_request, field_, parse_json
from .reasoning import prompt_opens_thinking

RENDER_TIMEOUT_S = 5.0   # a request chat template's render time (Qwen's own takes milliseconds)
# Unicode NFC (Qwen's normalizer) composes at most 4 code points into one: a text can shrink that
# much before tokenization (another normalizer is assumed to shrink no more).
NORMALIZER_SHRINK = 4


def chars_per_token(tokenizer) -> int:
    """The most characters of request text one token can stand for. A token covers at most as many
    characters as its vocabulary string has (one per byte for a byte-level BPE, whose strings are
    bytes), counted after the normalizer."""
    longest = max(map(len, tokenizer.backend.get_vocab(with_added_tokens=True)))
    return longest * (NORMALIZER_SHRINK if tokenizer.backend.normalizer is not None else 1)


def check_length(ctx, text: str, max_tokens: int | None, param: str) -> None:
    """Refuses, before tokenizing it, a prompt text that cannot fit with max_tokens beside it."""
    least = -(-len(text) // ctx.chars_per_token)
    if least + (max_tokens or 1) > ctx.limits.max_model_len:
        plus = f" plus {max_tokens} max tokens" if max_tokens else ""
        raise bad_request(f"This model's maximum context length is {ctx.limits.max_model_len} tokens. However, the "
                          f"prompt has {len(text)} characters, at least {least} tokens{plus}.", param)


class _RenderTimeout(BaseException):
    """Raised inside a runaway template; a BaseException so that no `except Exception` in the
    template engine swallows it."""


def _traced_until(deadline: float):
    def trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise _RenderTimeout
        return trace
    return trace


def render_chat(ctx, messages: list[dict], opts: dict) -> str:
    tok = ctx.tokenizer
    own = opts.get("chat_template")
    if own:
        tok = type(tok)(tok.backend, chat_template=own, bos_token=tok.bos_token, eos_token=tok.eos_token,
                        pad_token=tok.pad_token, source="request chat_template")
        sys.settrace(_traced_until(time.monotonic() + RENDER_TIMEOUT_S))
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=opts["add_generation_prompt"],
                                       tools=opts.get("tools"), **opts["kwargs"])
    except _RenderTimeout:
        raise bad_request(f"the request chat_template took longer than {RENDER_TIMEOUT_S:g} s to render",
                          "chat_template") from None
    except Exception as e:  # noqa: BLE001 - template errors come from the request's messages
        raise bad_request(f"could not render the chat template: {e}", "chat_template" if own else "messages") from None
    finally:
        sys.settrace(None)
    most = ctx.limits.max_model_len * ctx.chars_per_token
    if own and len(text) > most:  # the output-size limit: more than any prompt that can fit
        raise bad_request(f"the request chat_template rendered {len(text)} characters, more than a prompt of "
                          f"{ctx.limits.max_model_len} tokens can have ({most})", "chat_template")
    if opts.get("continue_final_message"):
        # Cut the rendered turn right after the last message's content, so the model continues it.
        last = (messages[-1].get("content") or "").strip()
        at = text.rfind(last) if last else -1
        if at >= 0:
            text = text[:at + len(last)]
    return text


def _encode(ctx, g: GenRequest, text: str, param: str) -> list[int]:
    if g.truncate_prompt_tokens:
        return ctx.tokenizer.encode(text)[-g.truncate_prompt_tokens:]
    check_length(ctx, text, g.params.max_tokens, param)
    return ctx.tokenizer.encode(text)


def completion(ctx, raw: bytes) -> tuple[GenRequest, list[list[int]], list[str]]:
    """A /v1/completions body: the request, each prompt's ids, and the prompt texts for echo."""
    body = parse_json(raw)
    check_model(body, ctx.model_name)
    g, prompts = completion_request(body, ctx.limits)
    tok = ctx.tokenizer
    ids = [_encode(ctx, g, p, "prompt") if isinstance(p, str) else p[-(g.truncate_prompt_tokens or len(p)):]
           for p in prompts]
    texts = [p if isinstance(p, str) else tok.decode(p) for p in prompts] if g.echo else []
    return g, ids, texts


def chat(ctx, raw: bytes) -> tuple[GenRequest, list[int], bool]:
    """A /v1/chat/completions body: the request, the prompt ids, whether the prompt opens thinking."""
    body = parse_json(raw)
    check_model(body, ctx.model_name)
    g, messages, opts = chat_request(body, ctx.limits, ctx.trust_request_chat_template)
    text = render_chat(ctx, messages, opts)
    return g, _encode(ctx, g, text, "messages"), prompt_opens_thinking(text)


def tokenize(ctx, raw: bytes) -> tuple[list[int], list[str] | None]:
    """A /tokenize body (a prompt, or messages in the chat form): the ids, and their strings if asked."""
    body = parse_json(raw)
    check_model(body, ctx.model_name)
    if "messages" in body:
        _, messages, opts = chat_request(dict(body, stream=False), ctx.limits, ctx.trust_request_chat_template)
        text = render_chat(ctx, messages, opts)
    else:
        text = field_(body, "prompt", str)
        if text is None:
            raise bad_request("'prompt' (a string) or 'messages' is required", "prompt")
    ids = ctx.tokenizer.encode(text, add_special_tokens=field_(body, "add_special_tokens", bool, default=True))
    strs = ctx.tokenizer.convert_ids_to_tokens(ids) if field_(body, "return_token_strs", bool, default=False) else None
    return ids, strs


def detokenize(ctx, raw: bytes) -> str:
    """A /detokenize body: the text of its token ids."""
    body = parse_json(raw)
    check_model(body, ctx.model_name)
    ids = field_(body, "tokens", list)
    vocab = ctx.limits.vocab_size
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
        raise bad_request(f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
    return ctx.tokenizer.decode(ids)
