"""Engine tokenizer: a `tokenizers` backend plus the checkpoint's jinja chat template."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Same as HF: jinja's own tojson HTML-escapes, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    # Environment settings mirror transformers' chat_template_utils so prompts match HF byte for byte.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Text <-> ids for one checkpoint. Qwen adds no BOS, so encode adds nothing by default."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        source: str = "<in-memory tokenizer>",
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.source = source

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_file = path / TOKENIZER_FILE
        if not tok_file.is_file():
            raise ValueError(f"tokenizer file not found: {tok_file}")
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
        config: dict[str, Any] = {}
        if (path / CONFIG_FILE).is_file():
            config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
        return cls(
            backend,
            chat_template=_load_chat_template(path, config),
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            source=str(path),
        )

    # --- ids <-> text -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch releases the GIL (encode holds it): a long text tokenized in a worker
        # thread then leaves the server's event loop running.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # Ids without a token (the embedding's padding rows) decode to nothing.
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of tokens incl. added ones (248077 for Qwen3.5), not the padded embedding size."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of(self.pad_token)

    # --- chat ---------------------------------------------------------------------------------

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError(
                f"no chat template for {self.source}: expected {TEMPLATE_FILE} or a "
                f"'chat_template' entry in {CONFIG_FILE}"
            )
        return _compile_template(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render messages to prompt text; template_kwargs (e.g. enable_thinking) reach the template."""
        variables: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
        }
        variables.update(template_kwargs)
        return self._template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        )


def _load_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    # As in HF, a standalone chat_template.jinja wins over the config entry.
    if (path / TEMPLATE_FILE).is_file():
        return (path / TEMPLATE_FILE).read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Streams text deltas token by token without splitting multi-byte characters.

    The vLLM / HF TextStreamer offsets technique: decode only the window ids[prefix:], compare
    with the already emitted part ids[prefix:read], and hold output back while it ends in U+FFFD
    (a byte-level token that ends mid-character). Decoding from a token before `read` keeps
    context-dependent decoders (e.g. a leading-space marker) right. Per token this costs a decode
    of the few tokens since the previous emission.
    """

    _PROMPT_CONTEXT = 5  # prompt tokens kept as decoding context, as vLLM does

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids or [])[-self._PROMPT_CONTEXT:]
        self._ids = context  # window; only ids from the prefix offset on are kept
        self._read = len(context)  # ids[:read] are already emitted (or are prompt)
        self._chunks: list[str] = []

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _emit(self, force: bool) -> str:
        prefix_text = self._decode(self._ids[: self._read])
        new_text = self._decode(self._ids)
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not force):
            return ""
        delta = new_text[len(prefix_text):]
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._chunks.append(delta)
        return delta

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text that became final (may be '')."""
        self._ids.append(token_id)
        return self._emit(force=False)

    def flush(self) -> str:
        """At end of stream: emit whatever was held back, even a genuinely broken tail."""
        return self._emit(force=True)

    @property
    def text(self) -> str:
        return "".join(self._chunks)
