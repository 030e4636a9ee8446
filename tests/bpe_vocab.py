"""A small byte-level BPE in the layout of the real Qwen3.5 tokenizer.json, trained at test time,
and a scripted checkpoint that greedily generates a chosen token sequence with it.

The tokenizer has the real pipeline (transformers' Qwen3_5Tokenizer builds the same one from the
vocabulary and merges): NFC, Qwen's split regex, ByteLevel without prefix space or its own regex,
BPE without byte fallback, the ByteLevel decoder. The regular vocabulary is padded to the real
248,044 ids with tokens no merge produces, so the added tokens sit at their real ids. Trained on
the few KB of CORPUS, many characters (most emoji, rare CJK, combining marks) stay split over
several byte-level tokens, which is what a streaming detokenizer must survive.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE

from engine.checkpoint import EOS_IDS, _to_bf16_bits, _write_safetensors, config_json
from engine.config import ModelConfig
from engine.vocab import ADDED_TOKENS, NUM_REGULAR, tokenizer_config
from engine.weights import expected_shapes

# tokenization_qwen3_5.py PRETOKENIZE_REGEX (spec §11): single digits, letters include \p{M}
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TRAINED_VOCAB = 1200  # small enough that many characters stay split (CORPUS: ~400 cuts inside characters)

CORPUS = """\
The quick brown fox jumps over the lazy dog. It's what they'll say, isn't it? We've seen 1234 cases.
def stream(tokens):
    for i, t in enumerate(tokens):  # 0x1F600 -> 😀
        yield {"id": i, "text": t}
Grüße aus Köln! Die Straße ist naß, der Bär schläft. Äpfel, Öl und Übermut.
Ça va ? L'été dernier, nous étions à Noël chez ma sœur. Où est la bibliothèque ? Garçon, un café crème !
¿Dónde está el niño? Mañana será otro día. El pingüino comió piñas.
Ελληνικά: Καλημέρα κόσμε, πώς είσαι; Русский: Привет, мир! Как дела? Съешь же ещё этих мягких булок.
你好，世界！今天天气很好，我们去公园散步吧。中文的分词没有空格，所以每个字都很重要。人工智能正在改变世界。
我爱北京天安门。学而时习之，不亦说乎？有朋自远方来，不亦乐乎？
日本語のテキストも必要です。こんにちは、世界。カタカナとひらがなと漢字が混ざっています。東京は晴れ。
한국어 문장도 있습니다. 안녕하세요, 세계! 오늘 날씨가 좋네요. 감사합니다.
ภาษาไทยก็มีวรรณยุกต์ สวัสดีครับ ขอบคุณมาก
हिन्दी में भी मात्राएँ हैं: नमस्ते दुनिया, आप कैसे हैं? संस्कृत और हिन्दी।
العربية: مَرْحَبًا بِالْعَالَمِ، كَيْفَ حَالُكَ؟ שָׁלוֹם עוֹלָם, מה שלומך?
Tiếng Việt có nhiều dấu: Xin chào thế giới, tôi yêu tiếng Việt lắm.
Combining marks that NFC cannot compose: q̇ x̧ m̂ n̈, and ones it can: é é ñ ñ.
Emoji: 😀😃😄😁 🙂🙃 👍🏽👍🏿 ❤️ 🔥 🎉🎊 👩‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 🇩🇪🇯🇵🇺🇸 ☕ 🍣🍜 🚀 ✨ 🤖 🧠
Math: ∑ x² + ∫ f(x) dx ≈ π ≠ ∞, α β γ δ ε. Arrows → ← ↑ ↓ ⇒. Currency: € £ ¥ ₹ ₩ ฿.
Mixed: 你好 world 🙂 naïve café 日本 한국 — “quotes” ‘single’ «guillemets» … ellipsis.
床前明月光，疑是地上霜。举头望明月，低头思故乡。春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。
深度学习模型需要大量的数据和计算资源。自然语言处理包括分词、词性标注、句法分析和机器翻译。
吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。何でも薄暗いじめじめした所で泣いていた。
{"name": "Zoë", "city": "Zürich", "tags": ["naïve", "café", "日本"], "score": 98.6, "ok": true}
https://example.com/path?q=%E4%BD%A0%E5%A5%BD&lang=zh-CN#frag  <b>bold</b> &amp; &lt;tag&gt;
for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // dot product, O(n)
The year 2024 had 366 days; 3.14159 is π, 2.71828 is e, and 6.022e23 is Avogadro's number.
Family: 👨‍👩‍👧 👩‍👩‍👦‍👦 · hands: 👋🏻👋🏼👋🏽👋🏾👋🏿 · flags: 🇫🇷🇮🇹🇪🇸🇧🇷🇮🇳 · faces: 🥲🫠🤯🥳😵‍💫
Zalgo-ish: Z̤͔ͧ̑a̢͎̫l̵̡g͉̗o̗͚ (stacked marks), Devanagari conjuncts: क्ष त्र ज्ञ श्र, Tamil: வணக்கம்.
Ünïcödé ëvërÿwhérë: ÀÁÂÃÄÅ àáâãäå ÈÉÊË èéêë ÌÍÎÏ ìíîï ÒÓÔÕÖ òóôõö ÙÚÛÜ ùúûü Çç Ññ.
"""


def _train() -> Tokenizer:
    tok = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                        byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TRAINED_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    return tok


def build_bpe() -> Tokenizer:
    raw = json.loads(_train().to_str())
    vocab = raw["model"]["vocab"]
    trained = len(vocab)
    # Unreachable fillers (no merge builds them) up to the real regular size; they decode to their text.
    vocab.update({f"<unused{i}>": i for i in range(trained, NUM_REGULAR)})
    tok = Tokenizer.from_str(json.dumps(raw))
    for content, special in ADDED_TOKENS:
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    if [tok.token_to_id(c) for c, _ in ADDED_TOKENS] != list(range(NUM_REGULAR, NUM_REGULAR + len(ADDED_TOKENS))):
        raise RuntimeError("added tokens did not land on their Qwen3.5 ids")
    return tok


def trained_ids(tok: Tokenizer) -> list[int]:
    """The ids of real (trained) BPE tokens, in id order."""
    return [i for i in range(NUM_REGULAR) if not tok.id_to_token(i).startswith("<unused")]


def write_bpe_tokenizer(out_dir: str | Path, tok: Tokenizer) -> Path:
    """tokenizer.json and tokenizer_config.json (the synthetic checkpoint's: ChatML template, special tokens)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False))
    return out


def byte_pieces(tok: Tokenizer) -> dict[bytes, int]:
    """The bytes each trained token stands for -> its id."""
    to_byte = {c: b for b, c in _byte_level_map().items()}
    return {bytes(to_byte[c] for c in tok.id_to_token(i)): i for i in trained_ids(tok)}


def _byte_level_map() -> dict[int, str]:
    """GPT-2's byte -> printable character map of the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def make_scripted_model(out_dir: str | Path, tok: Tokenizer, script: list[int], runners_up: list[int]) -> Path:
    """A tiny-shape checkpoint (this BPE tokenizer) whose greedy output after a prompt whose last token is
    not in `script` is `script`, then <|im_end|>; runners_up[j] is the second most likely token at
    output position j (len(script) + 1 of them), for logprobs. Every mixer and MLP writes zeros, so a
    position's logits depend on its own token only: script[i] embeds as the one-hot state i, every other
    token as state n; the lm_head scores the next token at 2 per state unit and the runner-up at 1."""
    n = len(script)
    if len(set(script)) != n or len(runners_up) != n + 1:
        raise ValueError("script tokens must be distinct (one successor each), with one runner-up per output")
    out = Path(out_dir)
    raw = config_json("tiny")
    cfg = ModelConfig.from_dict(raw)
    H, V = cfg.hidden_size, cfg.vocab_size
    if n >= H:
        raise ValueError(f"a script of {n} tokens needs hidden_size > {n}")
    embed = np.zeros((V, H), np.float32)
    embed[:, n] = 1.0
    embed[script, n] = 0.0
    embed[script, np.arange(n)] = 1.0
    head = np.zeros((V, H), np.float32)
    states = [n] + list(range(n))  # the state that output position j is predicted from
    for state, nxt, alt in zip(states, script + [EOS_IDS[0]], runners_up):
        head[nxt, state] = 2.0
        head[alt, state] = 1.0
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        full = name if name == "lm_head.weight" else "model.language_model." + name
        if name.endswith(("A_log", "linear_attn.norm.weight")):  # F32 in the published layout
            tensors[full] = np.zeros(shape, np.float32)
        else:
            value = {"embed_tokens.weight": embed, "lm_head.weight": head}.get(name, np.zeros(shape, np.float32))
            tensors[full] = _to_bf16_bits(value)
    out.mkdir(parents=True, exist_ok=True)
    _write_safetensors(out / "model.safetensors", tensors)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_IDS, "pad_token_id": 248044}))
    write_bpe_tokenizer(out, tok)
    return out
