"""Streaming detokenization with a real byte-level BPE (issue 17 item 6).

The tokenizer is a small BPE in the real Qwen3.5 tokenizer.json layout (tests/bpe_vocab.py), trained
here on mixed text, so CJK, emoji and combining marks are split over several tokens. The detokenizer
is checked on its own (every id sequence the BPE can spell a text with), then end to end through
`qwen35 serve` on a scripted checkpoint whose greedy output is a known token sequence: streamed text
equals non-streamed text equals the one-shot decode, no chunk holds a U+FFFD, stop strings cut where
they should, logprobs carry each token's own string (vLLM: the token decoded alone). The chat template
renders, and the tokenizer encodes, as transformers does with the same files.
"""
from __future__ import annotations

import asyncio
import json
import unicodedata

import httpx
import numpy as np
import pytest

from bpe_vocab import CORPUS, QWEN_SPLIT, build_bpe, byte_pieces, make_scripted_model, write_bpe_tokenizer
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.vocab import ADDED_TOKENS, NUM_REGULAR
from server_util import ServerProcess, sse_events

FFFD = "\ufffd"
IM_END = 248046
# What the scripted model says; its BPE encoding cuts a dozen characters (test_script_splits_characters)
SCRIPT_TEXT = "Grüße 你好世界 🙂 naïve café, 日本語のテキスト 한국어 👩‍💻 q̇ 🇩🇪 done."
PROMPT = "Zzz"  # its last token is not in the script, so the scripted model starts the script


@pytest.fixture(scope="module")
def backend():
    return build_bpe()


@pytest.fixture(scope="module")
def tok(backend) -> Tokenizer:
    return Tokenizer(backend)


@pytest.fixture(scope="module")
def pieces(backend) -> dict[bytes, int]:
    return byte_pieces(backend)


@pytest.fixture(scope="module")
def script(tok: Tokenizer) -> list[int]:
    return tok.encode(SCRIPT_TEXT)  # distinct tokens, as the scripted model needs


def _ends_mid_char(tok: Tokenizer, ids: list[int], skip: bool = True) -> list[bool]:
    """Per token of a valid text: does the text so far end inside a character?"""
    return [tok.decode(ids[:k + 1], skip_special_tokens=skip).endswith(FFFD) for k in range(len(ids))]


def _random_spelling(pieces: dict[bytes, int], text: str, rng) -> list[int]:
    """Any sequence of real tokens whose bytes are the text's: what a model may emit, not just BPE's choice."""
    data, pos, ids = text.encode(), 0, []
    longest = max(map(len, pieces))
    while pos < len(data):
        fits = [n for n in range(1, min(longest, len(data) - pos) + 1) if data[pos:pos + n] in pieces]
        n = int(rng.choice(fits))
        ids.append(pieces[data[pos:pos + n]])
        pos += n
    return ids


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids] + [detok.flush()]


# --- the tokenizer itself ---------------------------------------------------------------------


def test_layout_of_the_real_tokenizer(tok: Tokenizer, backend) -> None:
    assert tok.vocab_size == 248077
    assert [tok.token_to_id(t) for t, _ in ADDED_TOKENS] == list(range(NUM_REGULAR, NUM_REGULAR + len(ADDED_TOKENS)))
    raw = json.loads(backend.to_str())
    assert raw["normalizer"]["type"] == "NFC" and raw["decoder"]["type"] == "ByteLevel"
    split, byte_level = raw["pre_tokenizer"]["pretokenizers"]
    assert (split["type"], split["pattern"]["Regex"], split["behavior"]) == ("Split", QWEN_SPLIT, "Isolated")
    assert (byte_level["type"], byte_level["add_prefix_space"], byte_level["use_regex"]) == ("ByteLevel", False, False)
    assert raw["model"]["type"] == "BPE" and not raw["model"]["byte_fallback"]
    assert tok.encode("2024") == [tok.token_to_id(d) for d in "2024"]  # Qwen's regex: single digits
    assert tok.encode("<|im_start|>user") == [248045] + tok.encode("user")


def test_round_trip_is_nfc(tok: Tokenizer) -> None:
    for text in CORPUS.splitlines(keepends=True) + ["e\u0301 A\u030a \ufb01 \u212b 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🫠 \x00\x7f"]:
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_script_splits_characters(tok: Tokenizer, script) -> None:
    assert tok.decode(script) == SCRIPT_TEXT
    assert sum(_ends_mid_char(tok, script)) >= 10
    assert sum(_ends_mid_char(tok, tok.encode(CORPUS))) >= 100  # BPE's own encoding splits characters too


# --- IncrementalDetokenizer -------------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_stream_of_bpe_encoding_equals_decode(tok: Tokenizer, skip: bool) -> None:
    for line in CORPUS.splitlines(keepends=True):
        ids = tok.encode(f"<|im_start|>assistant\n<think>\n{line}</think>{line}<|im_end|>")
        deltas = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        assert not any(FFFD in d for d in deltas)
        # a token that ends inside a character emits nothing; the one that completes it emits it
        assert all(d == "" for d, mid in zip(deltas, _ends_mid_char(tok, ids, skip)) if mid)


def test_stream_of_any_spelling_equals_decode(tok: Tokenizer, pieces) -> None:
    """Random texts over the corpus' characters, spelled with random real tokens, after random prompts
    (whose 5-token context may start mid-character), with special tokens dropped in anywhere: skipped,
    they leave a character they cut whole; kept, they break it, and then the one-shot decode has U+FFFDs too."""
    rng = np.random.default_rng(17)
    chars = sorted(set(CORPUS))
    clean = 0
    for _ in range(300):
        text = "".join(rng.choice(chars, int(rng.integers(1, 30))))
        ids = _random_spelling(pieces, text, rng)
        assert tok.decode(ids) == text
        for k in rng.integers(0, len(ids) + 1, int(rng.integers(0, 3))):
            ids.insert(int(k), int(rng.choice([248045, IM_END, 248068, 248069])))
        prompt = _random_spelling(pieces, "".join(rng.choice(chars, int(rng.integers(0, 12)))), rng)
        for skip in (True, False):
            deltas = _stream(IncrementalDetokenizer(tok, prompt, skip), ids)
            full = tok.decode(ids, skip_special_tokens=skip)
            assert "".join(deltas) == full, (text, ids, deltas)
            if FFFD not in full:
                assert not any(FFFD in d for d in deltas), (text, ids, deltas)
                clean += 1
    assert clean > 300  # most cases have no broken character


def test_stream_of_invalid_bytes_keeps_each_replacement(tok: Tokenizer, pieces) -> None:
    """Bytes that never become a character: the stream still equals the one-shot decode (same U+FFFDs)."""
    lead, cont, emoji_lead = pieces[b"\xe4"], pieces[b"\xbd"], [pieces[b"\xf0"], pieces[b"\x9f"]]
    ids = [lead] + tok.encode("ab") + [cont] + tok.encode("好") + emoji_lead
    deltas = _stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == tok.decode(ids) == f"{FFFD}ab{FFFD}好{FFFD}"
    assert deltas[-1] == FFFD  # the broken tail comes out only at the end


# --- transformers compatibility --------------------------------------------------------------

QWEN35_CONFIG = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                 "text_config": {"model_type": "qwen3_5_text"}, "transformers_version": "5.2.0"}
TOOL = {"type": "function", "function": {"name": "天气", "description": "Wetter für <Ort> 🌦",
                                         "parameters": {"type": "object", "properties": {"城市": {"type": "string"}}}}}
CHATS = [
    ([{"role": "system", "content": "Sei kurz. 简短回答。"},
      {"role": "user", "content": [{"type": "text", "text": "你好 "}, {"type": "text", "text": "🙂 naïve"}]},
      {"role": "assistant", "content": "<think>\n想一想 q̇\n</think>\n\nGrüße 👩‍💻"},
      {"role": "user", "content": "日本語で？"}], None),
    ([{"role": "user", "content": "天气？"},
      {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "天气", "arguments": {"城市": "北京"}}}]},
      {"role": "tool", "content": "晴 ☀️ 25°C"}], [TOOL]),
]


@pytest.fixture(scope="module")
def tok_dir(backend, tmp_path_factory):
    return write_bpe_tokenizer(tmp_path_factory.mktemp("bpe"), backend)


@pytest.mark.parametrize("loader", ["AutoTokenizer", "Qwen3_5Tokenizer"])
def test_transformers_tokenizes_and_renders_the_same(tok_dir, loader: str) -> None:
    """AutoTokenizer loads the files as a real checkpoint's (with its config.json); Qwen3_5Tokenizer is
    the class newer transformers substitute, which rebuilds the pipeline from the vocabulary and merges."""
    transformers = pytest.importorskip("transformers")
    (tok_dir / "config.json").write_text(json.dumps(QWEN35_CONFIG))
    hf = getattr(transformers, loader).from_pretrained(str(tok_dir))
    ours = Tokenizer.from_dir(tok_dir)
    for text in [CORPUS, SCRIPT_TEXT, "<|im_start|>user\ne\u0301 \ufb01 𝔘 🫠<think>x</think><|im_end|>\n"]:
        ids = ours.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids
        for skip in (True, False):
            assert hf.decode(ids, skip_special_tokens=skip) == ours.decode(ids, skip_special_tokens=skip)
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX
    assert PRETOKENIZE_REGEX == QWEN_SPLIT
    for messages, tools in CHATS:
        for add, kwargs in ((True, {}), (True, {"enable_thinking": False}), (False, {})):
            text = ours.apply_chat_template(messages, add_generation_prompt=add, tools=tools, **kwargs)
            assert hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=add,
                                          **kwargs) == text
            hf_ids = hf.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=add,
                                            return_dict=True, **kwargs)["input_ids"]
            assert hf_ids == ours.encode(text)


# --- end to end: a scripted checkpoint behind `qwen35 serve` -------------------------------


@pytest.fixture(scope="module")
def runners_up(tok: Tokenizer, script) -> list[int]:
    """A whole-word runner-up at every output position, never the chosen token: two distinct top_logprobs."""
    words = [tok.encode(w)[0] for w in (" the", " fox")]
    return [words[0] if words[0] != t else words[1] for t in script + [IM_END]]


@pytest.fixture(scope="module")
def server(tmp_path_factory, backend, script, runners_up):
    d = make_scripted_model(tmp_path_factory.mktemp("scripted"), backend, script, runners_up)
    with ServerProcess(d, "--max-model-len", "512", "--max-num-seqs", "16", name="scripted") as s:
        yield s


def _post_all(server, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    """POSTs (path, body) all at once: the engine batches them, which keeps this module fast."""
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await asyncio.gather(*(c.post(path, json=body) for path, body in requests))
    responses = asyncio.run(main())
    for r in responses:
        assert r.status_code == 200, r.text
    return responses


def _completion_body(stream: bool, **kw) -> tuple[str, dict]:
    return "/v1/completions", {"model": "scripted", "prompt": PROMPT, "max_tokens": 200, "temperature": 0,
                               "stream": stream, **kw}


def _chat_body(stream: bool, **kw) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": "scripted", "messages": [{"role": "user", "content": "你好 🙂"}],
                                    "temperature": 0, "chat_template_kwargs": {"enable_thinking": False},
                                    "stream": stream, **kw}


def _completion_result(r: httpx.Response, stream: bool) -> tuple[str, list[str], dict]:
    """(text, the text of each streamed chunk, the choice with its logprobs joined over the chunks)."""
    if not stream:
        choice = r.json()["choices"][0]
        return choice["text"], [choice["text"]], choice
    chunks = [e["choices"][0] for e in sse_events(r.content)[:-1] if e["choices"]]
    lps = [c["logprobs"] for c in chunks if c["logprobs"]]
    lp = {k: sum((x[k] for x in lps), []) for k in ("tokens", "top_logprobs")} if lps else None
    return "".join(c["text"] for c in chunks), [c["text"] for c in chunks], dict(chunks[-1], logprobs=lp)


def test_prompt_is_outside_the_script(tok: Tokenizer, script) -> None:
    assert tok.encode(PROMPT)[-1] not in script


def test_served_text_equals_one_shot_decode(server, tok: Tokenizer) -> None:
    for stream, r in zip((False, True), _post_all(server, [_completion_body(False), _completion_body(True)])):
        text, chunks, choice = _completion_result(r, stream)
        assert text == tok.decode(tok.encode(SCRIPT_TEXT)) == SCRIPT_TEXT
        assert choice["finish_reason"] == "stop"
        assert not any(FFFD in c for c in chunks)
        assert len(chunks) > 10 or not stream  # it really streamed, piece by piece


def test_served_chat_content_equals_one_shot_decode(server) -> None:
    plain, streamed = _post_all(server, [_chat_body(False), _chat_body(True)])
    assert plain.json()["choices"][0]["message"]["content"] == SCRIPT_TEXT
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in sse_events(streamed.content)[:-1] if e["choices"]]
    assert "".join(deltas) == SCRIPT_TEXT
    assert not any(FFFD in d for d in deltas) and len(deltas) > 10


# how the stops fall on SCRIPT_TEXT's tokens (with this corpus and vocabulary size)
STOPS = [
    ("ïv", False),     # ï is cut between two tokens; the match ends inside the second
    ("👩‍💻", True),     # a ZWJ sequence over three tokens, each cut inside an emoji
    ("🇪", False),      # a regional indicator begun in one token and ended in the next
    ("テキ", True),     # begins in the middle of a token, spans two cut characters
    ("世界", True),     # a whole token
    (["キ", "日本"], False),  # the earlier of two matches wins (日本: inside a token, after its space)
]


def test_stop_strings_on_split_characters(server) -> None:
    requests = [_completion_body(stream, stop=stop, include_stop_str_in_output=include)
                for stop, include in STOPS for stream in (False, True)]
    responses = iter(_post_all(server, requests))
    for stop, include in STOPS:
        stops = [stop] if isinstance(stop, str) else stop
        matched = min(stops, key=SCRIPT_TEXT.index)
        want = SCRIPT_TEXT[:SCRIPT_TEXT.index(matched) + (len(matched) if include else 0)]
        for stream in (False, True):
            text, chunks, choice = _completion_result(next(responses), stream)
            assert text == want, (stop, include, stream)
            assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", matched)
            assert not any(FFFD in c for c in chunks)


def test_completion_logprobs_token_strings(server, tok: Tokenizer, script, runners_up) -> None:
    """Streamed as ids, the logprobs name the script and its runners-up; as strings, each token decoded alone."""
    ids = script + [IM_END]
    as_ids, as_strings = _post_all(server, [_completion_body(True, logprobs=2, return_tokens_as_token_ids=True),
                                            _completion_body(False, logprobs=2)])
    lp = _completion_result(as_ids, True)[2]["logprobs"]
    assert lp["tokens"] == [f"token_id:{i}" for i in ids]
    gap = 128 ** 0.5  # the runner-up's logit is sqrt(hidden_size) below the chosen one's (make_scripted_model)
    assert lp["top_logprobs"] == [{f"token_id:{i}": pytest.approx(0, abs=1e-3),
                                   f"token_id:{alt}": pytest.approx(-gap, abs=1e-2)} for i, alt in zip(ids, runners_up)]
    lp = as_strings.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert [set(top) for top in lp["top_logprobs"]] == [{tok.decode([i], skip_special_tokens=False), tok.decode([alt])}
                                                        for i, alt in zip(ids, runners_up)]
    # tokens that are whole characters read as the text itself
    whole = [s for s in lp["tokens"][:-1] if FFFD not in s]
    assert len(whole) > 10 and all(s in SCRIPT_TEXT for s in whole)
    assert lp["tokens"][-1] == "<|im_end|>"


def test_chat_logprobs_token_strings_and_bytes(server, tok: Tokenizer, script) -> None:
    (r,) = _post_all(server, [_chat_body(False, logprobs=True, top_logprobs=2)])
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [tok.decode([i], skip_special_tokens=False) for i in script + [IM_END]]
    for e in content:
        assert e["bytes"] == list(e["token"].encode())  # vLLM: the UTF-8 of the token string
        assert e["top_logprobs"][0]["token"] == e["token"] and len(e["top_logprobs"]) == 2
