import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.vocab import ADDED_TOKENS, NUM_REGULAR, write_tokenizer

QWEN35_CONFIG = {
    "model_type": "qwen3_5",
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "text_config": {"model_type": "qwen3_5_text"},
    # Without it transformers assumes an old checkpoint and warns about a Mistral regex.
    "transformers_version": "5.2.0",
}
SAMPLE = "<|im_start|>user\nHello, wörld! 你好 🙂 Å ﬁ\r\n\t  x<think>y</think><|im_end|>\n"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synthetic_tokenizer")
    start = time.perf_counter()
    write_tokenizer(out)
    assert time.perf_counter() - start < 5
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    return out


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


# --- synthetic vocabulary -------------------------------------------------------------------


def test_every_regular_id_is_one_distinct_char(tok: Tokenizer) -> None:
    ids = list(range(NUM_REGULAR))
    text = tok.decode(ids)
    assert len(text) == NUM_REGULAR
    assert tok.encode(text) == ids


@pytest.mark.parametrize("length", [1, 2, 17, 500, 2000])
def test_decode_encode_round_trip(tok: Tokenizer, length: int) -> None:
    rng = np.random.default_rng(length)
    for _ in range(5):
        ids = rng.integers(0, NUM_REGULAR, size=length).tolist()
        assert tok.encode(tok.decode(ids)) == ids


def test_special_tokens_at_qwen35_ids(tok: Tokenizer) -> None:
    expected = {
        "<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046,
        "<|vision_start|>": 248053, "<|image_pad|>": 248056, "<tool_call>": 248058,
        "<tool_response>": 248066, "<think>": 248068, "</think>": 248069, "<|audio_pad|>": 248076,
    }
    for token, token_id in expected.items():
        assert tok.token_to_id(token) == token_id
        assert tok.id_to_token(token_id) == token
    assert [tok.token_to_id(t) for t, _ in ADDED_TOKENS] == list(range(248044, 248077))
    assert tok.vocab_size == 248077
    assert tok.id_to_token(248077) is None
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (248046, 248044, None)
    assert tok.encode("<|im_start|>user") == [248045] + tok.encode("user")
    assert tok.convert_ids_to_tokens([248045, tok.token_to_id("u")]) == ["<|im_start|>", "u"]


def test_english_is_one_token_per_char(tok: Tokenizer) -> None:
    text = "The quick brown fox\tjumps over the lazy dog.\r\n{json: [1, 2]} ~`!@#$%^&*()_+|\\"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert max(ids) < 98  # printable ASCII, \n, \t, \r come first
    assert tok.decode(ids) == text


def test_decode_skips_only_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\n<think>\nhm</think>\n\nok<|im_end|>")
    # <think> is not special in the real checkpoint either, so reasoning parsers can see it.
    assert tok.decode(ids) == "assistant\n<think>\nhm</think>\n\nok"
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>")
    assert tok.decode([65, 248100, 66]) == "ab"  # padding-row ids decode to nothing


# --- chat template --------------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    {"role": "assistant", "content": "<think>\nsecret\n</think>\n\nHello!"},
    {"role": "user", "content": "Bye"},
]
HISTORY = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nHi there<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n"
    "<|im_start|>user\nBye<|im_end|>\n"
)


def test_chat_template_thinking_default(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(MESSAGES) == HISTORY + "<|im_start|>assistant\n<think>\n"
    assert tok.apply_chat_template(MESSAGES, enable_thinking=True) == HISTORY + "<|im_start|>assistant\n<think>\n"


def test_chat_template_thinking_disabled(tok: Tokenizer) -> None:
    expected = HISTORY + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(MESSAGES, enable_thinking=False) == expected


def test_chat_template_without_generation_prompt(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == HISTORY


def test_chat_template_tools(tok: Tokenizer) -> None:
    tool = {"type": "function", "function": {"name": "get_time", "description": "Zeit <now>"}}
    messages = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "12:00"},
    ]
    text = tok.apply_chat_template(messages, tools=[tool])
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(tool, ensure_ascii=False) in text  # HF-style tojson: no HTML escaping
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n' in text
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n" in text


def test_chat_template_sources(tok_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tok_dir / "tokenizer.json", tmp_path)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([]) == "D<|im_end|>"
    (tmp_path / "chat_template.jinja").write_text("F{{ messages | length }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "F1"


def test_missing_files_give_clear_errors(tok_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    shutil.copy(tok_dir / "tokenizer.json", tmp_path)
    bare = Tokenizer.from_dir(tmp_path)  # no config: still usable for ids
    assert bare.encode("ab") == [65, 66]
    assert bare.eos_token_id is None
    with pytest.raises(ValueError, match="chat_template.jinja"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_raise_exception_in_template(tok: Tokenizer) -> None:
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="Unsupported content part type: image"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}])


# --- Hugging Face compatibility -------------------------------------------------------------


@pytest.mark.parametrize("with_model_config", [False, True])
def test_hf_autotokenizer_matches(tok_dir: Path, tok: Tokenizer, tmp_path: Path, with_model_config: bool) -> None:
    transformers = pytest.importorskip("transformers")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, tmp_path)
    if with_model_config:
        (tmp_path / "config.json").write_text(json.dumps(QWEN35_CONFIG))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = tok.encode(SAMPLE)
    assert hf.encode(SAMPLE, add_special_tokens=False) == ids
    assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (248046, 248044, None)
    for thinking in (True, False):
        ours = tok.apply_chat_template(MESSAGES, enable_thinking=thinking)
        theirs = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        assert theirs == ours
    rng = np.random.default_rng(0)
    random_ids = rng.integers(0, NUM_REGULAR, size=300).tolist()
    assert hf.encode(hf.decode(random_ids), add_special_tokens=False) == random_ids


# --- incremental detokenizer ----------------------------------------------------------------

MULTIBYTE = "Grüße 你好世界, naïve café 😀🎉 👩‍💻 日本語のテキスト 한국어 ok\n"


@pytest.fixture(scope="module")
def byte_bpe() -> Tokenizer:
    """Tiny byte-level BPE: most non-ASCII characters span several tokens."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|eot|>"]
    )
    backend.train_from_iterator(["hello world", "Grüße aus Köln", "你好", "the cat sat on the mat"] * 20, trainer)
    return Tokenizer(backend)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


def test_byte_bpe_really_splits_characters(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode("界😀")
    assert len(ids) > 2
    assert any("\ufffd" in byte_bpe.decode([i]) for i in ids)


def test_incremental_byte_level_bpe(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode(MULTIBYTE)
    detok = IncrementalDetokenizer(byte_bpe)
    deltas = _stream(detok, ids)
    assert "".join(deltas) == detok.text == byte_bpe.decode(ids) == MULTIBYTE
    assert not any("\ufffd" in d for d in deltas)
    assert deltas.count("") > 3  # some tokens were held back mid-character


def test_incremental_with_prompt_and_special_tokens(byte_bpe: Tokenizer) -> None:
    eot = byte_bpe.token_to_id("<|eot|>")
    prompt = byte_bpe.encode("prompt 你")
    out = byte_bpe.encode("好 😀") + [eot] + byte_bpe.encode("界")
    for skip in (True, False):
        detok = IncrementalDetokenizer(byte_bpe, prompt_ids=prompt, skip_special_tokens=skip)
        deltas = _stream(detok, out)
        assert "".join(deltas) == byte_bpe.decode(out, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_flush_emits_broken_tail(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode("ab😀")
    cut = next(n for n in range(len(ids)) if byte_bpe.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(byte_bpe)
    assert "".join(detok.add(i) for i in ids[:cut]) == "ab"
    assert detok.flush() == byte_bpe.decode(ids[:cut])[2:]
    assert detok.text == byte_bpe.decode(ids[:cut])


def test_incremental_random_bytes_match_full_decode(byte_bpe: Tokenizer) -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        ids = rng.integers(0, byte_bpe.vocab_size, size=int(rng.integers(1, 60))).tolist()
        detok = IncrementalDetokenizer(byte_bpe)
        assert "".join(_stream(detok, ids)) == byte_bpe.decode(ids)


def test_incremental_synthetic(tok: Tokenizer) -> None:
    rng = np.random.default_rng(2)
    ids = rng.integers(0, NUM_REGULAR, size=200).tolist() + [248046, 248068] + tok.encode("end")
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("<|im_start|>assistant\n"))
    deltas = _stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert all(len(d) <= 1 for d in deltas[:200])  # one char per regular token, nothing held
