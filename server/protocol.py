"""Request parsing and validation: JSON bodies of the OpenAI endpoints into a `GenRequest`.

Everything a client can get wrong is checked here, before any engine work or response header,
and raised as a 4xx that names the parameter and the offending value. Checked here: the JSON
types, and what only the HTTP API has (n, streaming, prompts, messages); the sampling values are
checked by `SamplingParams.validate`, the engine's one validator, whose error names the parameter.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from engine.sampling_params import SamplingParams, SamplingParamsError

from .engine_io import EngineLimits
from .errors import APIError, bad_request

# A \u escape of a UTF-16 surrogate: a valid pair decodes to one character, a lone one to a
# string no encoder accepts, which must not get past the parser.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")  # Python's json accepts NaN and Infinity


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
        if _SURROGATE_ESCAPE.search(raw):
            json.dumps(body, ensure_ascii=False).encode()
    except RecursionError:
        raise bad_request("malformed JSON body: nested too deeply") from None
    except UnicodeEncodeError:
        raise bad_request("malformed JSON body: a \\u escape is a lone UTF-16 surrogate, not a character") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def _type_name(types) -> str:
    return " or ".join(_JSON_TYPES.get(t, t.__name__) for t in types)


def _show(v) -> str:
    """The offending value, short; containers by their JSON type only (they may be nested deeply)."""
    if isinstance(v, (list, dict)):
        return "an " + _JSON_TYPES[type(v)]
    return json.dumps(v)[:80]


def field_(body: dict, key: str, *types, default=None):
    """body[key] checked against types (null = absent); bool is not accepted as a number."""
    v = body.get(key)
    if v is None:
        return default
    ok = any(isinstance(v, t) and not (isinstance(v, bool) and t is not bool) for t in types)
    if float in types and isinstance(v, int) and not isinstance(v, bool):
        try:
            ok, v = True, float(v)
        except OverflowError:
            raise bad_request(f"'{key}' must be a finite number", key) from None
    if not ok:
        raise bad_request(f"'{key}' must be {_type_name(types)}, got {_show(v)}", key)
    return v


def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise bad_request(message, param)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class GenRequest:
    """One validated generation request; prompts are filled in by the handler (tokenization)."""
    params: SamplingParams = None       # validated; max_tokens None: up to max_model_len
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    n: int = 1
    echo: bool = False
    tokens_as_ids: bool = False
    truncate_prompt_tokens: int | None = None

    @property
    def logprobs(self) -> int | None:
        """completions: top-n count; chat: top_logprobs (None = off)."""
        return self.params.logprobs


def check_model(body: dict, served: str) -> None:
    model = field_(body, "model", str)
    if model is not None and model != served:
        raise APIError(404, f"The model `{model}` does not exist.", "model")


_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _token_ids(body: dict, key: str) -> list:
    ids = field_(body, key, list, default=[])
    _check(all(map(_is_int, ids)), f"'{key}' must be an array of integers", key)
    return ids


def _logit_bias(body: dict) -> dict:
    bias = field_(body, "logit_bias", dict, default={})
    for tok, val in bias.items():
        # a key is a token id in decimal; at most 10 digits, so int() never meets a huge number
        _check(tok.isascii() and tok.isdigit() and len(tok) <= 10, f"logit_bias key {_show(tok)} is not a token id",
               "logit_bias")
        _check(isinstance(val, (int, float)) and not isinstance(val, bool),
               f"logit_bias value for {tok} must be a number, got {_show(val)}", "logit_bias")
    return {int(tok): val for tok, val in bias.items()}


def _sampling(body: dict, limits: EngineLimits, max_tokens: int | None, logprobs: int | None,
              names: dict[str, str]) -> SamplingParams:
    """The request's SamplingParams. names: SamplingParams field -> this endpoint's parameter."""
    kw = {key: field_(body, key, float) for key in _FLOATS}
    kw["top_k"] = field_(body, "top_k", int)
    kw["seed"] = field_(body, "seed", int)
    # Unset temperature/top_p/top_k stay None: the engine fills them from generation_config.json.
    kw = {k: v for k, v in kw.items() if v is not None}
    try:
        params = SamplingParams(
            max_tokens=max_tokens, logprobs=logprobs, **kw,
            stop=field_(body, "stop", str, list, default=[]), stop_token_ids=_token_ids(body, "stop_token_ids"),
            logit_bias=_logit_bias(body), min_tokens=field_(body, "min_tokens", int, default=0),
            ignore_eos=field_(body, "ignore_eos", bool, default=False),
            include_stop_str_in_output=field_(body, "include_stop_str_in_output", bool, default=False),
            skip_special_tokens=field_(body, "skip_special_tokens", bool, default=True))
        params.validate(limits.vocab_size, limits.max_logprobs)
    except SamplingParamsError as e:
        name = names.get(e.param, e.param)
        raise bad_request(name + str(e)[len(e.param):], name) from None
    return params


def _common(body: dict, limits: EngineLimits) -> GenRequest:
    g = GenRequest()
    g.n = field_(body, "n", int, default=1)
    _check(1 <= g.n <= limits.max_num_seqs, f"n must be in [1, {limits.max_num_seqs}] (--max-num-seqs), got {g.n}",
           "n")
    for key, why in (("prompt_logprobs", "prompt logprobs are not supported"),
                     ("allowed_token_ids", "allowed_token_ids is not supported"),
                     ("bad_words", "bad_words is not supported"),
                     ("guided_json", "guided decoding is not supported"), ("structured_outputs", "structured outputs "
                     "are not supported"), ("suffix", "suffix is not supported")):
        if body.get(key) not in (None, [], {}):
            raise bad_request(why, key)
    best_of = field_(body, "best_of", int)
    _check(best_of in (None, 1) or best_of == g.n, "best_of is not supported (vLLM V1 removed it)", "best_of")
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
        _check(1 <= trunc <= limits.max_model_len, f"truncate_prompt_tokens must be in [1, {limits.max_model_len}], "
               f"got {trunc}", "truncate_prompt_tokens")
        g.truncate_prompt_tokens = trunc
    return g


def completion_request(body: dict, limits: EngineLimits) -> tuple[GenRequest, list]:
    """Returns the request and its prompts, each a str or a list of token ids."""
    g = _common(body, limits)
    # OpenAI's completions default is 16; an explicit null means up to max_model_len
    max_tokens = field_(body, "max_tokens", int) if "max_tokens" in body else 16
    g.echo = field_(body, "echo", bool, default=False)
    lp = field_(body, "logprobs", int)
    _check(lp is None or not g.echo, "echo together with logprobs needs prompt logprobs, which are not supported",
           "logprobs")
    g.params = _sampling(body, limits, max_tokens, lp, {})
    prompts = _prompts(body.get("prompt"), limits.vocab_size)
    # One engine request per prompt and sample: refused whole, before any of them is queued.
    total = len(prompts) * g.n
    _check(total <= limits.max_waiting_requests, f"this request needs {total} engine requests ({len(prompts)} "
           f"prompts x n={g.n}), more than the {limits.max_waiting_requests} that can wait (--max-waiting-requests)",
           "n")
    return g, prompts


def _prompts(prompt, vocab_size: int) -> list:
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    def is_ids(x) -> bool:
        return isinstance(x, list) and all(map(_is_int, x))

    if isinstance(prompt, str) or (is_ids(prompt) and prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise bad_request("'prompt' must be a string, a list of strings, a list of token ids or a list of token-id "
                          "lists", "prompt")
    for p in prompts:
        _check(len(p) > 0, "the prompt is empty", "prompt")
        if not isinstance(p, str):
            bad = [i for i in p if not 0 <= i < vocab_size]
            _check(not bad, f"prompt token id {bad[0] if bad else ''} is out of range [0, {vocab_size})", "prompt")
    return prompts


def chat_request(body: dict, limits: EngineLimits, trust_request_chat_template: bool = False
                 ) -> tuple[GenRequest, list[dict], dict]:
    """Returns the request, the normalized messages and the template options."""
    g = _common(body, limits)
    mt_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"  # deprecated
    top = None
    if field_(body, "logprobs", bool, default=False):
        top = field_(body, "top_logprobs", int, default=0)
    elif body.get("top_logprobs") not in (None, 0):
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    names = {"max_tokens": mt_key, "logprobs": "top_logprobs"}
    g.params = _sampling(body, limits, field_(body, mt_key, int), top, names)
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
    # A template is code: as vLLM, only a server started with the flag runs one from a request.
    _check(trust_request_chat_template or (opts["chat_template"] is None and "chat_template" not in kwargs),
           "a request chat_template is refused: the server was not started with --trust-request-chat-template",
           "chat_template")
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
    # vLLM's `reasoning` and its older name `reasoning_content`: the template reads the latter
    for key in ("reasoning", "reasoning_content"):
        _check(isinstance(m.get(key), (str, type(None))), f"messages[{i}].{key} must be a string", "messages")
    if out.get("reasoning_content") is None and m.get("reasoning") is not None:
        out["reasoning_content"] = m["reasoning"]
    return out
