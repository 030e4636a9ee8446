"""Synthetic tokenizer for random-weight test checkpoints.

Every regular token is exactly one distinct Unicode character and the pre-tokenizer isolates
every character, so ``encode(decode(ids)) == ids`` for any sequence of regular ids; a benchmark
can therefore build prompts of an exact token length. Added tokens sit at their real Qwen3.5 ids.
(The one way to break the round trip is to decode regular ids that spell out an added token,
e.g. the seven characters of ``<think>``; random ids essentially never do.)
"""

from __future__ import annotations

import json
import sys
import unicodedata
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel

NUM_REGULAR = 248044
VOCAB_SIZE = 248320  # embedding rows; ids 248077.. have no token
MODEL_MAX_LENGTH = 262144

# (content, special) in id order from 248044. special=False mirrors the real checkpoint: those
# stay visible in decode(skip_special_tokens=True), which reasoning/tool parsers rely on.
ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]

# ChatML with Qwen3-style tools and <think> handling (simplified from the Qwen3.5 template).
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is none -%}
{%- else -%}{%- for part in content -%}
{%- if part.type == 'text' -%}{{ part.text }}
{%- else -%}{{ raise_exception('Unsupported content part type: ' ~ part.type) }}
{%- endif -%}
{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- render_content(messages[0].content) + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- set content = render_content(message.content) %}
{%- if message.role == 'system' %}
{%- if not (tools and loop.first) %}{{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role == 'assistant' %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{{- '<|im_start|>assistant\\n' + content }}
{%- for tool_call in message.tool_calls or [] %}
{%- set fn = tool_call.function if tool_call.function is defined else tool_call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""


def _usable(ch: str) -> bool:
    """A character that no normaliser changes and that cannot combine with a neighbour."""
    cat = unicodedata.category(ch)
    if cat == "Co":  # private use: inert
        return True
    if cat[0] in "MC" or cat in ("Zl", "Zp"):  # marks, controls, format, unassigned, separators
        return False
    if ch == "\ufffd":  # streaming treats a trailing U+FFFD as an incomplete byte sequence
        return False
    if 0x1100 <= ord(ch) <= 0x11FF or 0xA960 <= ord(ch) <= 0xA97F or 0xD7B0 <= ord(ch) <= 0xD7FF:
        return False  # conjoining Hangul jamo compose into syllables under NFC
    return unicodedata.normalize("NFC", ch) == ch and unicodedata.normalize("NFKC", ch) == ch


def regular_chars() -> list[str]:
    """The NUM_REGULAR token characters in id order: ASCII first, then BMP, then higher planes."""
    ascii_first = [chr(c) for c in range(0x20, 0x7F)] + ["\n", "\t", "\r"]
    chars = list(ascii_first)
    for cp in range(0xA0, sys.maxunicode + 1):
        if len(chars) == NUM_REGULAR:
            break
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        if _usable(ch):
            chars.append(ch)
    if len(chars) != NUM_REGULAR:
        raise RuntimeError(f"only {len(chars)} usable characters")
    return chars


def build_tokenizer() -> Tokenizer:
    vocab = {ch: i for i, ch in enumerate(regular_chars())}
    # WordLevel needs its unk token in its own vocab; adding it below then reuses this id.
    vocab[ADDED_TOKENS[0][0]] = NUM_REGULAR
    tok = Tokenizer(WordLevel(vocab, unk_token=ADDED_TOKENS[0][0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    for content, special in ADDED_TOKENS:
        # normalized=False: match the raw text; lstrip/rstrip off like the real checkpoint.
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    return tok


def tokenizer_config() -> dict:
    decoder = {
        str(NUM_REGULAR + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "TokenizersBackend",
        "unk_token": None,
    }


def write_tokenizer(out_dir: str | Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into out_dir (created if needed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    ids = [tok.token_to_id(c) for c, _ in ADDED_TOKENS]
    if ids != list(range(NUM_REGULAR, NUM_REGULAR + len(ADDED_TOKENS))):
        raise RuntimeError("added tokens did not land on their Qwen3.5 ids")
    tok.save(str(out / "tokenizer.json"))
    with open(out / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(), f, indent=2, ensure_ascii=False)
        f.write("\n")
