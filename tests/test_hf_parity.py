"""The float32 logits gate: the NumPy reference against Hugging Face Qwen3_5ForCausalLM.

Prompts of several lengths (crossing the 64-token chunk boundary), then decode steps through the
cache; chunked prefill must match one-shot prefill. The gate must have teeth: each classic bug of
spec §13, patched into the reference, makes it fail, and so do the two subtle ones the bf16 GPU gate
needs its sublayer rows for (RoPE theta / 10, q/k norm weights dropped); here the sublayer rows
themselves are checked against HF (they must match in f32, and a planted bug must first show at the
first attention layer), the machinery test_gpu_hf_gate.py relies on.
"""
import numpy as np
import pytest

from engine import backend_numpy as bn
from engine.backend_numpy import NumpyBackend
from engine.config import ModelConfig
from engine.model import Qwen35Model
from engine.step import Step
from engine.weights import load_weights
from hf_gate_util import HFSublayers, SUBTLE_BUGS, hf_or_skip, plant_bug, record_sublayers, sublayer_errors, \
    sublayer_names

torch, transformers = hf_or_skip()  # QWEN35_REQUIRE_HF (CI): a skipped gate is a failed gate

BOUND = 1e-4
DECODE = 8
BLOCK = 16


class Ref:
    """Our model plus HF's, on one checkpoint."""

    def __init__(self, model_dir):
        cfg = ModelConfig.from_dir(model_dir)
        self.model = Qwen35Model(cfg, load_weights(model_dir, cfg), NumpyBackend())
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.rng = np.random.default_rng(1234)

    def hf_logits(self, ids):
        with torch.no_grad():
            return self.hf(torch.tensor(np.asarray(ids)[None])).logits[0].numpy()

    def run(self, ids, prompt_len, chunk=None):
        """Prefill ids[:prompt_len] (in chunks of `chunk`), then decode the rest one by one.
        Returns logits at each chunk end and each decode step, with their positions."""
        cache = self.model.alloc_cache(2, 2 + len(ids) // BLOCK, BLOCK)
        blocks = list(range(1, 2 + len(ids) // BLOCK))
        chunk = chunk or prompt_len
        out, pos = [], []
        bounds = list(range(0, prompt_len, chunk)) + list(range(prompt_len, len(ids)))
        ends = bounds[1:] + [len(ids)]
        for s, e in zip(bounds, ends):
            out.append(self.model.forward(Step.build([(list(ids[s:e]), s, 1, blocks)]), cache)[0])
            pos.append(e - 1)
        return np.stack(out), pos


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=["tiny", "tiny3"])
def ref(request):
    return Ref(request.getfixturevalue(f"{request.param}_dir"))


@pytest.mark.parametrize("prompt_len", [1, 7, 64, 65, 300])
def test_prefill_then_decode_matches_hf(ref, prompt_len):
    ids = ref.rng.integers(0, 248044, prompt_len + DECODE)
    ours, pos = ref.run(ids, prompt_len)
    assert rel_err(ours, ref.hf_logits(ids)[pos]) <= BOUND


@pytest.mark.parametrize("chunk", [1, 17, 64])
def test_chunked_prefill_matches_one_shot(ref, chunk):
    ids = ref.rng.integers(0, 248044, 150 + DECODE)
    hf = ref.hf_logits(ids)
    ours, pos = ref.run(ids, 150, chunk)
    one_shot, pos1 = ref.run(ids, 150)
    assert rel_err(ours, hf[pos]) <= BOUND
    assert rel_err(ours[-DECODE - 1:], one_shot[-DECODE - 1:]) <= BOUND


def _tiled(x, r):
    return np.tile(x, (1, r, 1))


def _contiguous_q_gate(qg, nh, hd):
    return qg[:, :nh * hd].reshape(-1, nh, hd), qg[:, nh * hd:]


def _gptj_rope(x, pos, rd, theta):
    inv = 1.0 / theta ** (np.arange(0, rd, 2) / rd)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., 0:rd:2], x[..., 1:rd:2]
    rot = np.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).reshape(x[..., :rd].shape)
    return np.concatenate([rot, x[..., rd:]], -1).astype(np.float32)


@pytest.mark.parametrize("name,bug", [
    ("gdn_qk_heads", _tiled),                     # h % nk instead of h // r
    ("gated_norm_weight", lambda w: 1.0 + w),     # (1+w) on the GDN output norm
    ("split_q_gate", _contiguous_q_gate),         # [q_all | gate_all]
    ("rope", _gptj_rope),                         # interleaved pairs instead of NeoX halves
])
def test_gate_catches_classic_bug(ref, monkeypatch, name, bug):
    ids = ref.rng.integers(0, 248044, 70 + DECODE)
    hf = ref.hf_logits(ids)
    monkeypatch.setattr(bn, name, bug)
    ours, pos = ref.run(ids, 70)
    assert rel_err(ours, hf[pos]) > 100 * BOUND, f"the gate misses the {name} bug"


@pytest.mark.parametrize("bug", SUBTLE_BUGS)
def test_gate_catches_subtle_bug(ref, monkeypatch, bug):
    ids = ref.rng.integers(0, 248044, 70 + DECODE)
    hf = ref.hf_logits(ids)
    plant_bug(monkeypatch, NumpyBackend, bug)
    ours, pos = ref.run(ids, 70)
    assert rel_err(ours, hf[pos]) > 100 * BOUND, f"the gate misses the {bug} bug"


@pytest.fixture(scope="module")
def prompts(ref):
    return [ref.rng.integers(0, 248044, n) for n in (300, 70, 1)]  # 300: more than the rows kept per prompt


@pytest.fixture(scope="module")
def hf_sublayers(ref, prompts):
    hooks = HFSublayers(ref.hf)
    try:
        with torch.no_grad():  # the decoder alone: no lm_head over every position
            return [hooks.record(lambda p=p: ref.hf.model(torch.tensor(p[None])))[1] for p in prompts]
    finally:
        hooks.remove()


def sublayer_rows(ref, prompts, hf_sublayers):
    """Per sublayer: our outputs' relative distance from HF's, the prompts prefilled in one step."""
    need = [len(p) // BLOCK + 1 for p in prompts]
    cache = ref.model.alloc_cache(len(prompts) + 1, sum(need) + 1, BLOCK)
    tables = np.split(np.arange(1, sum(need) + 1), np.cumsum(need)[:-1])
    step = Step.build([(list(p), 0, i + 1, t.tolist()) for i, (p, t) in enumerate(zip(prompts, tables))])
    return sublayer_errors(record_sublayers(ref.model, step, cache)[1], hf_sublayers)


def test_sublayer_rows_match_hf(ref, prompts, hf_sublayers):
    rows = sublayer_rows(ref, prompts, hf_sublayers)
    names = sublayer_names(ref.model.cfg)
    assert len(rows) == len(names) and rows.max() <= BOUND, dict(zip(names, rows))


@pytest.mark.parametrize("bug", SUBTLE_BUGS)
def test_sublayer_rows_locate_subtle_bug(ref, prompts, hf_sublayers, monkeypatch, bug):
    plant_bug(monkeypatch, NumpyBackend, bug)
    rows = sublayer_rows(ref, prompts, hf_sublayers)
    first_attention = 2 * ref.model.cfg.full_layers[0]
    assert rows[:first_attention].max() <= BOUND
    assert rows[first_attention] > 100 * BOUND, f"the sublayer rows miss the {bug} bug"


@pytest.mark.parametrize("preset", ["tiny", "tiny3"])
def test_hf_loads_checkpoint_without_missing_or_unexpected(request, preset):
    d = request.getfixturevalue(f"{preset}_dir")
    _, info = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
