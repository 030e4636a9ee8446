"""Request parsing and validation: JSON bodies of the OpenAI endpoints into a `GenRequest`.

Everything a client can get wrong is checked here, before any engine work or response header,
and raised as a 400 that names the parameter and the offending value.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .errors import APIError, bad_request

MAX_LOGPROBS = 20  # vLLM --max-logprobs default


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _type_name(types) -> str:
    names = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def field_(body: dict, key: str, *types, default=None):
    """body[key] checked against types (null = absent); bool is not accepted as a number."""
    v = body.get(key)
    if v is None:
        return default
    ok = any(isinstance(v, t) and not (isinstance(v, bool) and t is not bool) for t in types)
    if float in types and isinstance(v, int) and not isinstance(v, bool):
        ok, v = True, float(v)
    if not ok:
        raise bad_request(f"'{key}' must be {_type_name(types)}, got {json.dumps(v)[:80]}", key)
    return v


def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise bad_request(message, param)


@dataclass
class GenRequest:
    """One validated generation request; prompts are filled in by the handler (tokenization)."""
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    n: int = 1
    max_tokens: int | None = None       # None: up to max_model_len
    params: dict = field(default_factory=dict)  # engine SamplingParams keyword arguments (but max_tokens)
    logprobs: int | None = None         # completions: top-n count; chat: top_logprobs (None = off)
    echo: bool = False
    tokens_as_ids: bool = False
    truncate_prompt_tokens: int | None = None


def check_model(body: dict, served: str) -> None:
    model = field_(body, "model", str)
    if model is not None and model != served:
        raise APIError(404, f"The model `{model}` does not exist.", "model")


def _sampling(body: dict, g: GenRequest, vocab_size: int, max_model_len: int) -> None:
    # Unset temperature/top_p/top_k stay None: the engine fills them from generation_config.json.
    p: dict[str, Any] = {}
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        v = field_(body, key, int if key == "top_k" else float)
        if v is not None:
            p[key] = v
    t = p.get("temperature", 1.0)
    _check(t >= 0, f"temperature must be non-negative, got {t}", "temperature")
    _check(0 < p.get("top_p", 1.0) <= 1, f"top_p must be in (0, 1], got {p.get('top_p')}", "top_p")
    k = p.get("top_k", -1)
    _check(k >= -1, f"top_k must be -1 or 0 (disable) or at least 1, got {k}", "top_k")
    _check(0 <= p.get("min_p", 0.0) <= 1, f"min_p must be in [0, 1], got {p.get('min_p')}", "min_p")
    rp = p.get("repetition_penalty", 1.0)
    _check(rp > 0, f"repetition_penalty must be greater than zero, got {rp}", "repetition_penalty")
    for key in ("presence_penalty", "frequency_penalty"):
        _check(-2 <= p.get(key, 0.0) <= 2, f"{key} must be in [-2, 2], got {p.get(key)}", key)

    seed = field_(body, "seed", int)
    if seed is not None:
        p["seed"] = seed
    p["ignore_eos"] = field_(body, "ignore_eos", bool, default=False)
    stop_ids = field_(body, "stop_token_ids", list, default=[])
    _check(all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in stop_ids),
           f"stop_token_ids must be token ids in [0, {vocab_size})", "stop_token_ids")
    p["stop_token_ids"] = list(stop_ids)
    min_tokens = field_(body, "min_tokens", int, default=0)
    _check(min_tokens >= 0, f"min_tokens must be non-negative, got {min_tokens}", "min_tokens")
    if g.max_tokens is not None:
        _check(min_tokens <= g.max_tokens, f"min_tokens ({min_tokens}) must be at most max_tokens ({g.max_tokens})",
               "min_tokens")
    p["min_tokens"] = min_tokens
    bias = field_(body, "logit_bias", dict)
    if bias:
        parsed = {}
        for tok, val in bias.items():
            _check(str(tok).isdecimal() and int(tok) < vocab_size, f"logit_bias key {tok!r} is not a token id in "
                   f"[0, {vocab_size})", "logit_bias")
            _check(isinstance(val, (int, float)) and not isinstance(val, bool) and -100 <= val <= 100,
                   f"logit_bias value for {tok} must be a number in [-100, 100], got {val!r}", "logit_bias")
            parsed[int(tok)] = float(val)
        p["logit_bias"] = parsed
    stop = field_(body, "stop", str, list, default=[])
    stop = [stop] if isinstance(stop, str) else stop
    _check(all(isinstance(s, str) and s for s in stop), "stop must be a non-empty string or a list of them", "stop")
    p["stop"] = stop
    p["include_stop_str_in_output"] = field_(body, "include_stop_str_in_output", bool, default=False)
    p["skip_special_tokens"] = field_(body, "skip_special_tokens", bool, default=True)
    g.params = p
    g.tokens_as_ids = field_(body, "return_tokens_as_token_ids", bool, default=False)
    g.stream = field_(body, "stream", bool, default=False)
    opts = field_(body, "stream_options", dict)
    if opts is not None:
        _check(g.stream, "stream_options is only allowed when stream is true", "stream_options")
        # vLLM's StreamOptions defaults include_usage to true once the object is given.
        g.include_usage = field_(opts, "include_usage", bool, default=True)
        g.continuous_usage = field_(opts, "continuous_usage_stats", bool, default=False)
    trunc = field_(body, "truncate_prompt_tokens", int)
    if trunc is not None:
        _check(1 <= trunc <= max_model_len, f"truncate_prompt_tokens must be in [1, {max_model_len}], got {trunc}",
               "truncate_prompt_tokens")
        g.truncate_prompt_tokens = trunc


def _common(body: dict, max_n: int) -> GenRequest:
    g = GenRequest()
    g.n = field_(body, "n", int, default=1)
    _check(1 <= g.n <= max_n, f"n must be in [1, {max_n}] (--max-num-seqs), got {g.n}", "n")
    for key, why in (("prompt_logprobs", "prompt logprobs are not supported"),
                     ("allowed_token_ids", "allowed_token_ids is not supported"),
                     ("bad_words", "bad_words is not supported"),
                     ("guided_json", "guided decoding is not supported"), ("structured_outputs", "structured outputs "
                     "are not supported"), ("suffix", "suffix is not supported")):
        if body.get(key) not in (None, [], {}):
            raise bad_request(why, key)
    best_of = field_(body, "best_of", int)
    _check(best_of in (None, 1) or best_of == g.n, "best_of is not supported (vLLM V1 removed it)", "best_of")
    return g


def _max_tokens(body: dict, key: str) -> int | None:
    mt = field_(body, key, int)
    _check(mt is None or mt >= 1, f"{key} must be at least 1, got {mt}", key)
    return mt


def completion_request(body: dict, *, vocab_size: int, max_model_len: int, max_n: int
                       ) -> tuple[GenRequest, list]:
    """Returns the request and its prompts, each a str or a list of token ids."""
    g = _common(body, max_n)
    g.max_tokens = _max_tokens(body, "max_tokens")
    if "max_tokens" not in body:
        g.max_tokens = 16  # OpenAI completions default
    _sampling(body, g, vocab_size, max_model_len)
    g.echo = field_(body, "echo", bool, default=False)
    lp = field_(body, "logprobs", int)
    if lp is not None:
        _check(0 <= lp <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}], got {lp}", "logprobs")
        _check(not g.echo, "echo together with logprobs needs prompt logprobs, which are not supported", "logprobs")
    g.logprobs = lp
    return g, _prompts(body.get("prompt"), vocab_size)


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


def _prompts(prompt, vocab_size: int) -> list:
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(prompt, str) or (_is_ids(prompt) and prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise bad_request("'prompt' must be a string, a list of strings, a list of token ids or a list of token-id "
                          "lists", "prompt")
    for p in prompts:
        _check(len(p) > 0, "the prompt is empty", "prompt")
        if not isinstance(p, str):
            bad = [i for i in p if not 0 <= i < vocab_size]
            _check(not bad, f"prompt token id {bad[:1]} is out of range [0, {vocab_size})", "prompt")
    return prompts


def chat_request(body: dict, *, vocab_size: int, max_model_len: int, max_n: int
                 ) -> tuple[GenRequest, list[dict], dict]:
    """Returns the request, the normalized messages and the template options."""
    g = _common(body, max_n)
    g.max_tokens = _max_tokens(body, "max_completion_tokens")
    if g.max_tokens is None:
        g.max_tokens = _max_tokens(body, "max_tokens")  # deprecated alias
    _sampling(body, g, vocab_size, max_model_len)
    if field_(body, "logprobs", bool, default=False):
        top = field_(body, "top_logprobs", int, default=0)
        _check(0 <= top <= MAX_LOGPROBS, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        g.logprobs = top
    elif body.get("top_logprobs") not in (None, 0):
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    _check(not field_(body, "echo", bool, default=False), "echo is not supported for chat completions", "echo")
    fmt = field_(body, "response_format", dict)
    _check(fmt is None or fmt.get("type") == "text", "response_format other than {\"type\": \"text\"} is not "
           "supported", "response_format")
    choice = body.get("tool_choice")
    _check(choice in (None, "none", "auto"), "tool_choice must be 'none' or 'auto' (forced tool calls are not "
           "supported)", "tool_choice")
    msgs = body.get("messages")
    _check(isinstance(msgs, list) and len(msgs) > 0, "'messages' must be a non-empty array", "messages")
    messages = [_message(m, i) for i, m in enumerate(msgs)]
    kwargs = field_(body, "chat_template_kwargs", dict, default={})
    opts = {"add_generation_prompt": field_(body, "add_generation_prompt", bool, default=True),
            "continue_final_message": field_(body, "continue_final_message", bool, default=False),
            "tools": field_(body, "tools", list) if choice != "none" else None,
            "chat_template": field_(body, "chat_template", str), "kwargs": dict(kwargs)}
    _check(not (opts["add_generation_prompt"] and opts["continue_final_message"]),
           "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message")
    return g, messages, opts


def _message(m, i: int) -> dict:
    _check(isinstance(m, dict) and isinstance(m.get("role"), str), f"messages[{i}] must be an object with a "
           "string 'role'", "messages")
    out = dict(m)
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: only text is supported
        texts = []
        for part in content:
            _check(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str),
                   f"messages[{i}].content: only parts of type 'text' are supported", "messages")
            texts.append(part["text"])
        out["content"] = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return out
