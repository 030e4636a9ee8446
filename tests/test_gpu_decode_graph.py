"""CUDA-graph decode (engine/gpu/decode_graph.py) against eager execution on the tiny models.

A replay must equal eager execution of the same padded step bit for bit (logits and every conv,
recurrent and KV array outside the dummy slot / page), batches that straddle buckets must work with the
padding absorbed by the dummy slot and page (slots and pages no sequence owns stay untouched), and the
result must agree with the ordinary unpadded eager forward up to bf16 rounding.
"""
import numpy as np
import pytest

from conftest import gpu_or_skip  # noqa: E402

cupy = gpu_or_skip()

from engine.gpu.backend import CudaBackend  # noqa: E402
from engine.ops import Cache  # noqa: E402
from engine.gpu.decode_graph import DecodeGraphs, bucket_sizes  # noqa: E402
from engine.step import Step  # noqa: E402

pytestmark = pytest.mark.gpu
BS = 16
DUMMY_SLOT, DUMMY_BLOCK = 0, 0
_MODELS = {}


def _model(request, preset):
    if preset not in _MODELS:
        from engine.config import ModelConfig
        from engine.model import Qwen35Model
        from engine.weights import load_weights

        d = request.getfixturevalue(f"{preset}_dir")
        cfg = ModelConfig.from_dir(d)
        _MODELS[preset] = Qwen35Model(cfg, load_weights(d, cfg), CudaBackend())
    return _MODELS[preset]


def copy_cache(c):
    return Cache([a.copy() for a in c.conv], [a.copy() for a in c.rec], [a.copy() for a in c.k],
                 [a.copy() for a in c.v], c.block_size, conv_log=[a.copy() for a in c.conv_log],
                 rec_log=[a.copy() for a in c.rec_log])


def host(c):
    return {name: [cupy.asnumpy(a) for a in getattr(c, name)] for name in ("conv", "rec", "k", "v", "conv_log", "rec_log")}


def bits(x):
    x = np.ascontiguousarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.itemsize])


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all() and np.isfinite(b).all()
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def bf(x):  # bf16 bits -> f32
    return (np.asarray(x).astype(np.uint32) << 16).view(np.float32)


class World:
    """n sequences prefilled eagerly in random non-contiguous slots and pages; spare slot and pages
    nobody owns are filled with a pattern, the dummy slot and page with garbage."""

    def __init__(self, model, n, steps, seed, spec_logs=0, spec_tokens=0, long=()):
        """long: {sequence: prompt length} overriding the random 1..39 tokens."""
        rng = np.random.default_rng(seed)
        self.model, self.rng = model, rng
        self.lens = [int(x) for x in rng.integers(1, 40, n)]
        for i, L in dict(long).items():
            self.lens[i] = L
        need = [-(-(L + steps) // BS) for L in self.lens]
        self.num_slots = n + 2                                 # dummy + n + one spare
        self.num_blocks = 1 + sum(need) + 3                    # dummy + owned + spares
        self.slots = [int(s) for s in rng.permutation(np.arange(1, self.num_slots))[:n]]
        pages = [int(p) for p in rng.permutation(np.arange(1, self.num_blocks))]
        self.blocks, o = [], 0
        for k in need:
            self.blocks.append(pages[o:o + k])
            o += k
        self.spare_blocks = pages[o:]
        self.spare_slots = sorted(set(range(1, self.num_slots)) - set(self.slots))
        self.width = max(need) + 2                              # graphs wider than any table
        c = self.cache = model.alloc_cache(self.num_slots, self.num_blocks, BS, spec_logs, spec_tokens)
        for a in c.conv + c.rec + c.k + c.v + c.conv_log + c.rec_log:  # garbage everywhere, then prefill
            if a.dtype == cupy.uint16:
                a[...] = cupy.asarray(rng.integers(0, 1 << 16, a.shape, dtype=np.uint16) & 0x3FFF)  # finite, < 2
            else:
                a[...] = cupy.asarray(rng.standard_normal(a.shape).astype(np.float32))
        model.ops.reset_slots(c, self.slots)
        prompts = [list(rng.integers(0, 248000, L)) for L in self.lens]
        model.forward(Step.build([(p, 0, s, b) for p, s, b in zip(prompts, self.slots, self.blocks)]), c)
        cupy.cuda.Device().synchronize()

    def decode_step(self, which, pos_of):
        """A decode step of sequences `which` (in that order); pos_of[i]: its position now."""
        toks = self.rng.integers(0, 248000, len(which))
        return Step.build([([int(t)], pos_of[i], self.slots[i], self.blocks[i]) for t, i in zip(toks, which)])


def check_untouched(w, before, after):
    """Spare slots and spare pages equal their state before the decode steps, bit for bit."""
    for name in ("conv", "rec"):
        for a0, a1 in zip(before[name], after[name]):
            assert np.array_equal(bits(a0[w.spare_slots]), bits(a1[w.spare_slots])), f"{name}: spare slot written"
    for name in ("k", "v"):
        for a0, a1 in zip(before[name], after[name]):
            assert np.array_equal(bits(a0[w.spare_blocks]), bits(a1[w.spare_blocks])), f"{name}: spare page written"


def check_equal_state(a, b, what):
    """Bit-equal everywhere but the dummy slot / page."""
    for name in ("conv", "rec"):
        for i, (x, y) in enumerate(zip(a[name], b[name])):
            assert np.array_equal(bits(x[1:]), bits(y[1:])), f"{what}: {name}[{i}] differs"
    for name in ("k", "v"):
        for i, (x, y) in enumerate(zip(a[name], b[name])):
            assert np.array_equal(bits(x[1:]), bits(y[1:])), f"{what}: {name}[{i}] differs"


def check_replayed(w, before, eager_c, plain_c):
    """After replays on w.cache: its state equals the eager padded steps' (eager_c) bit for bit, spare slots and
    pages are untouched, and the real sequences' state agrees with the unpadded eager path's (plain_c) up to
    bf16 rounding."""
    g, e, p = host(w.cache), host(eager_c), host(plain_c)
    check_equal_state(g, e, "replay vs eager padded")
    check_untouched(w, before, g)
    for x, y in zip(g["rec"], p["rec"]):
        assert rel(x[w.slots], y[w.slots]) <= 5e-2
    for name in ("conv", "k", "v"):
        for x, y in zip(g[name], p[name]):
            idx = w.slots if name == "conv" else sum(w.blocks, [])
            assert rel(bf(x[idx]), bf(y[idx])) <= 5e-2


def test_bucket_sizes():
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert bucket_sizes(112) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112]
    assert bucket_sizes(6) == [1, 2, 4, 6]


@pytest.mark.parametrize("preset", ["tiny", "tiny3"])
@pytest.mark.parametrize("B", [1, 3, 5, 33])  # 3 -> 4, 5 -> 8, 33 -> 48 (15 padded rows)
def test_graph_decode_bit_exact(request, preset, B):
    model = _model(request, preset)
    steps = 4
    w = World(model, B, steps, seed=B * 7 + len(preset))
    eager_c, plain_c = copy_cache(w.cache), copy_cache(w.cache)
    before = host(w.cache)
    graphs = DecodeGraphs(model, w.cache, max_num_seqs=48, dummy_slot=DUMMY_SLOT, dummy_block=DUMMY_BLOCK,
                          max_blocks_per_seq=w.width)
    assert graphs.bucket_for(B) == {1: 1, 3: 4, 5: 8, 33: 48}[B]
    order = list(range(B))
    worst = 0.0
    for s in range(steps):
        st = w.decode_step(order, [L + s for L in w.lens])
        got = cupy.asnumpy(graphs.run(st))
        want = cupy.asnumpy(graphs.eager(st, eager_c))
        plain = cupy.asnumpy(model.forward(st, plain_c))
        assert got.shape == (B, model.cfg.vocab_size)
        assert np.array_equal(bits(got), bits(want)), f"step {s}: replay != eager padded"
        worst = max(worst, rel(got, plain))
    check_replayed(w, before, eager_c, plain_c)
    print(f"{preset} B={B}: replay vs unpadded eager logits rel err {worst:.2e}")
    assert worst <= 5e-2


@pytest.mark.parametrize("preset", ["tiny", "tiny3"])
def test_graph_mixed_batches(request, preset):
    """Batches of changing size and order switch buckets between replays (one shared private pool)."""
    model = _model(request, preset)
    n, sizes = 7, [5, 3, 7, 1, 4, 2, 6]
    w = World(model, n, len(sizes), seed=11 + len(preset))
    eager_c = copy_cache(w.cache)
    before = host(w.cache)
    graphs = DecodeGraphs(model, w.cache, max_num_seqs=8, dummy_slot=DUMMY_SLOT, dummy_block=DUMMY_BLOCK,
                          max_blocks_per_seq=w.width, capture_now=True)
    assert sorted(graphs.graphs) == [(1, 0), (2, 0), (4, 0), (8, 0)]
    pos = list(w.lens)
    for k in sizes:
        which = [int(i) for i in w.rng.permutation(n)[:k]]
        st = w.decode_step(which, pos)
        got = cupy.asnumpy(graphs.run(st))
        # the metadata run() wrote over the bucket's padding: the padded step's packed layout
        assert np.array_equal(graphs.graphs[graphs.bucket_for(k), 0].staging, graphs.pad(st).packed(BS))
        want = cupy.asnumpy(graphs.eager(st, eager_c))
        assert np.array_equal(bits(got), bits(want)), f"batch {k}: replay != eager padded"
        for i in which:
            pos[i] += 1
    check_equal_state(host(w.cache), host(eager_c), "replay vs eager padded")
    check_untouched(w, before, host(w.cache))


def test_graph_rejects_non_decode(request):
    model = _model(request, "tiny")
    w = World(model, 2, 1, seed=3)
    graphs = DecodeGraphs(model, w.cache, max_num_seqs=4, dummy_slot=DUMMY_SLOT, dummy_block=DUMMY_BLOCK,
                          max_blocks_per_seq=w.width)
    prefill = Step.build([([1, 2], w.lens[0], w.slots[0], w.blocks[0])])
    with pytest.raises(ValueError):
        graphs.run(prefill)
    dummy = Step.build([([1], w.lens[0], DUMMY_SLOT, w.blocks[0])])
    with pytest.raises(ValueError):
        graphs.run(dummy)
    with pytest.raises(ValueError):
        graphs.run(Step.build([([1], w.lens[0], w.slots[0], w.blocks[0])] * 5))


@pytest.mark.parametrize("preset", ["tiny", "tiny3"])
def test_graph_verify_bit_exact(request, preset):
    """Uniform verifies of K drafts (speculative decoding), each after the first replaying some of the last
    one's tokens (step.py), replay from their own graphs: logits, the activations a drafter reads (a capture),
    the slots' states and every log set equal eager execution of the padded step bit for bit, padded rows
    write only the dummy slot, page and log set, and a decode step that replays still replays its own graph
    after."""
    from engine.model import Capture
    model = _model(request, preset)
    B, K, steps = 3, 3, 3
    w = World(model, B, steps * (1 + K), seed=5 + len(preset), spec_logs=B + 1, spec_tokens=K)
    spec = {i: i for i in range(B)}  # log set B: the padding's
    eager_c, plain_c = copy_cache(w.cache), copy_cache(w.cache)
    before = host(w.cache)
    graphs = DecodeGraphs(model, w.cache, max_num_seqs=4, dummy_slot=DUMMY_SLOT, dummy_block=DUMMY_BLOCK,
                          max_blocks_per_seq=w.width, verify_k=K, dummy_spec_log=B,
                          capture=Capture(post_norm=True, taps=(0,)))
    pos = list(w.lens)
    worst = 0.0
    for s in range(steps):
        toks = w.rng.integers(0, 248000, (B, 1 + K))
        replay = {i: 1 + (s + i) % (1 + K) for i in range(B)} if s else None
        st = Step.build([([int(t) for t in toks[i]], pos[i], w.slots[i], w.blocks[i]) for i in range(B)],
                        [1 + K] * B, spec=spec, replay=replay)
        assert graphs.kind(st) == K
        got, got_cap = graphs.run(st, with_capture=True)
        assert np.array_equal(graphs.graphs[4, K].staging, graphs.pad(st).packed(BS))
        want, want_cap = graphs.eager(st, eager_c, with_capture=True)
        got, want = cupy.asnumpy(got), cupy.asnumpy(want)
        plain = cupy.asnumpy(model.forward(st, plain_c))
        assert got.shape == (B * (1 + K), model.cfg.vocab_size)
        assert sorted(got_cap) == ["post_norm", "taps"]
        for name in got_cap:
            assert got_cap[name].shape[0] == B * (1 + K)
            assert np.array_equal(bits(cupy.asnumpy(got_cap[name])), bits(cupy.asnumpy(want_cap[name]))), name
        assert np.array_equal(bits(got), bits(want)), f"step {s}: replay != eager padded"
        worst = max(worst, rel(got, plain))
        pos = [p + 1 + K for p in pos]
    assert (4, K) in graphs.graphs
    g, e = host(w.cache), host(eager_c)
    for name in ("conv", "rec"):  # every row but the dummy slot, every log set but the padding's
        for x, y in zip(g[name], e[name]):
            assert np.array_equal(bits(x[1:]), bits(y[1:])), f"{name} differs"
    for name in ("conv_log", "rec_log"):
        for x, y in zip(g[name], e[name]):
            assert np.array_equal(bits(x[:B]), bits(y[:B])), f"{name} differs"
    for name in ("k", "v"):
        for x, y in zip(g[name], e[name]):
            assert np.array_equal(bits(x[1:]), bits(y[1:])), f"{name} differs"
    check_untouched(w, before, g)
    assert worst <= 5e-2, worst
    st = w.decode_step(list(range(B)), pos)
    st.spec_logs, st.replay = np.arange(B, dtype=np.int32), np.array([1, 2, 1 + K][:B], np.int32)
    assert graphs.kind(st) == 0
    assert np.array_equal(bits(cupy.asnumpy(graphs.run(st))), bits(cupy.asnumpy(graphs.eager(st, eager_c))))
    g, e = host(w.cache), host(eager_c)
    for name in ("conv", "rec"):  # a decode's replay writes the slot
        for x, y in zip(g[name], e[name]):
            assert np.array_equal(bits(x[1:]), bits(y[1:])), f"{name} differs after a replaying decode"
    mixed = Step.build([([1, 2], pos[0], w.slots[0], w.blocks[0]), ([3], pos[1], w.slots[1], w.blocks[1])],
                       [2, 1], spec={0: spec[0]})
    assert graphs.kind(mixed) is None  # not uniform: eager


@pytest.mark.parametrize("preset", ["tiny", "tiny3"])
@pytest.mark.parametrize("ctx", ["short", "long"])
def test_graph_small_mixed_steps(request, preset, ctx):
    """Small mixed steps (decodes, then a few prompt chunks within mixed_cap tokens) replay their decode bucket's
    mixed graph: logits and every state equal eager execution of the padded layout bit for bit, agree with the
    unpadded eager forward up to bf16 rounding, and the padding (decode rows, empty chunk sequences, the filler)
    writes only the dummy slot and page. Steps cover buckets 1 (no decodes), 4 and 8, one to three chunks, a
    one-token chunk, sampled and unsampled chunk ends, and fed decode tokens. ctx "long": the chunks continue
    1100-2000-token prompts, so attn_prefill splits their tiles' keys into parts (in the graph too)."""
    from engine.gpu.decode_graph import MIXED
    model = _model(request, preset)
    n, cap = 8, 100
    w = World(model, n, 160, seed=21 + len(preset), long={5: 1100, 6: 1500, 7: 2000} if ctx == "long" else ())
    eager_c, plain_c = copy_cache(w.cache), copy_cache(w.cache)
    before = host(w.cache)
    graphs = DecodeGraphs(model, w.cache, max_num_seqs=8, dummy_slot=DUMMY_SLOT, dummy_block=DUMMY_BLOCK,
                          max_blocks_per_seq=w.width, mixed_cap=cap)
    pos = list(w.lens)
    # (decoding sequences, [(chunk sequence, tokens, sampled)])
    plan = [([0, 1, 2], [(5, 37, True)]), ([], [(6, 60, False), (7, 1, True)]),
            ([3, 0, 1, 2, 4], [(5, 20, False), (6, 1, False), (7, 70, True)]), ([2], [(5, 99, True)])]
    worst = 0.0
    for s, (dec, chunks) in enumerate(plan):
        toks = [[int(t)] for t in w.rng.integers(0, 248000, len(dec))]
        toks += [[int(t) for t in w.rng.integers(0, 248000, c)] for _, c, _ in chunks]
        seqs = dec + [i for i, _, _ in chunks]
        fed = dec and s in (0, 3)  # the decodes' tokens come from the device (0 in the host's rows)
        st = Step.build([([0] if fed and j < len(dec) else t, pos[i], w.slots[i], w.blocks[i])
                         for j, (t, i) in enumerate(zip(toks, seqs))],
                        [1] * len(dec) + [int(smp) for _, _, smp in chunks],
                        feed=(np.arange(len(dec)), cupy.asarray(np.array([t[0] for t in toks[:len(dec)]], np.int32)))
                        if fed else None)
        assert graphs.kind(st) == MIXED
        tiles = graphs.mixed.lay_out(st, graphs.bucket_for(len(dec)))[1]
        split = tiles[tiles[:, 3] > 0, 6] >= 0  # (the padding's empty tiles are zeros)
        assert split.any() == (ctx == "long"), "attn_prefill's key split: in every long step, in no short one"
        got = cupy.asnumpy(graphs.run(st))
        want = cupy.asnumpy(graphs.eager(st, eager_c))
        plain = cupy.asnumpy(model.forward(st, plain_c))
        assert got.shape == (len(st.logits_rows), model.cfg.vocab_size)
        assert np.array_equal(bits(got), bits(want)), f"step {s}: replay != eager padded"
        worst = max(worst, rel(got, plain))
        for t, i in zip(toks, seqs):
            pos[i] += len(t)
    assert sorted(graphs.graphs) == [(1, MIXED), (4, MIXED), (8, MIXED)]
    check_replayed(w, before, eager_c, plain_c)
    print(f"{preset}: mixed replay vs unpadded eager logits rel err {worst:.2e}")
    assert worst <= 5e-2
