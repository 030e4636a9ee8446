"""Engine on the NumPy backend with the tiny random model."""
import asyncio

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.engine import AdmissionError, Engine, EngineDeadError, OverloadedError
from engine.checkpoint import EOS_IDS

GREEDY = dict(temperature=0.0)


def prompt(seed, n):
    return np.random.default_rng(seed).integers(0, 200000, n).tolist()


class Collect:
    """An event sink that keeps every event per request."""

    def __init__(self):
        self.events = {}

    def __call__(self, out):
        self.events.setdefault(out.request_id, []).append(out)

    def tokens(self, rid):
        return [t for e in self.events[rid] for t in e.new_token_ids]

    def text(self, rid):
        return "".join(e.new_text for e in self.events[rid])

    def last(self, rid):
        return self.events[rid][-1]


def drive(eng, col, rids, max_steps=500):
    for _ in range(max_steps):
        if all(r in col.events and col.last(r).finished for r in rids):
            return
        eng.step()
    raise AssertionError("requests did not finish")


def make(model, **kw):
    """A loop-less engine driven by step() from the test, and an event collector. model: the tiny
    model's dir (CPU), or a (dir, device) target."""
    model, device = model if isinstance(model, tuple) else (model, "cpu")
    if device == "cuda":
        kw.setdefault("kv_cache_memory", 4 << 30)  # several engines live at once in these tests
    return Engine(model, start=False, device=device, **kw), Collect()


@pytest.fixture(scope="module")
def llm(tiny_dir):
    llm = LLM(tiny_dir, device="cpu", max_num_seqs=16, max_num_batched_tokens=256)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def target_llm(target):
    model_dir, device = target
    llm = LLM(model_dir, device=device, max_num_seqs=16, max_num_batched_tokens=256,
              **({"kv_cache_memory": 4 << 30} if device == "cuda" else {}))
    yield llm
    llm.shutdown()


def _record_greedy_logits(store):
    """A runner logits hook keeping each greedy row's raw logits by (prompt, output index)."""
    def hook(sampled, logits):
        for i, req in enumerate(sampled):
            if req.params.temperature == 0:
                store[(tuple(req.prompt_ids), len(req.output_ids))] = np.array(logits[i])
        return logits
    return hook


def _first_flip(p, want, got, la, lb):
    """Where two greedy generations of prompt p first differ (None: they agree, length too): (index, mean
    |dlogit|, max |dlogit|, margin in la's run, margin in lb's run) from their recorded raw logits there,
    or (index, inf, ...) when a run has no logits there (one stopped early)."""
    k = next((j for j, (x, y) in enumerate(zip(want, got)) if x != y), None)
    if k is None:
        return None if want == got else (min(len(want), len(got)), np.inf, np.inf, 0.0, 0.0)
    a, b = la[(tuple(p), k)], lb[(tuple(p), k)]
    d = np.abs(a - b)
    return k, float(d.mean()), float(d.max()), float(a[want[k]] - a[got[k]]), float(b[got[k]] - b[want[k]])


BF16_NOISE = 0.12  # mean |dlogit| of HF's own bf16 vs f32 on the random 4b checkpoint (tests/test_gpu_hf_gate.py)


@pytest.fixture(scope="module", params=[pytest.param(False, id="default"), pytest.param(True, id="invariant")])
def alone_vs_batch(request, target, target_llm):
    """16 mixed requests (even: greedy; odd: seeded top-k sampling), each generated alone and then
    all inside one engine with arrivals spread over steps, by default engines or batch_invariant ones
    (the prompts then chunked at multiples of 64 by a smaller budget). Returns (invariant, specs, alone,
    batched, raw logits of the greedy rows alone and batched)."""
    invariant = request.param
    llm = target_llm
    if invariant:
        model_dir, device = target
        llm = LLM(model_dir, device=device, max_num_seqs=16, max_num_batched_tokens=256, batch_invariant=True,
                  **({"kv_cache_memory": 4 << 30} if device == "cuda" else {}))
    specs = [(prompt(i, 3 + 7 * i), SamplingParams(max_tokens=4 + i % 5, temperature=0.0 if i % 2 == 0 else 0.9,
                                                   top_k=[5, 20][i % 4 // 2], seed=i, min_p=0.01 * (i % 3),
                                                   repetition_penalty=1 + 0.1 * (i % 3)))
             for i in range(16)]
    la, lb = {}, {}
    llm.engine.runner.logits_hook = _record_greedy_logits(la)
    try:
        alone = [llm.generate([p], sp)[0].token_ids for p, sp in specs]
    finally:
        llm.engine.runner.logits_hook = None
        if invariant:
            llm.shutdown()
    # invariant: the least budget allowed (16 + 2 * 64), so the longer prompts are cut at 64 or 128
    eng, col = make(target, max_num_seqs=16, max_num_batched_tokens=144 if invariant else 48,
                    batch_invariant=invariant)
    eng.runner.logits_hook = _record_greedy_logits(lb)
    rids = []
    for i, (p, sp) in enumerate(specs):
        rids.append(eng.submit(p, sp, col))
        if i % 3 == 2:
            eng.step()
    drive(eng, col, rids)
    st = eng.stats()
    assert st.kv_blocks_used == 0 and st.state_slots_free == 16 and st.running == 0 and st.waiting == 0
    eng.shutdown()
    return invariant, specs, alone, [col.tokens(r) for r in rids], la, lb


def test_greedy_alone_equals_inside_mixed_batch(target, alone_vs_batch):
    """Tokens bit-identical on the NumPy backend, and with batch_invariant on the GPU too, where every
    greedy row's logits are also bit-identical (NumPy's BLAS rounds by M). By default on the GPU, bf16 logits depend in their last bits on the batch shape
    (cublasLt picks its algorithm by M, the decode attention split follows the batch, prefill chunks split
    the GDN and attention work differently), so on the random 4b checkpoint, whose top logits are often
    within 0.05 of each other, a greedy token may flip: there, the outputs must agree exactly up to the
    flip and the logits at the flip must differ by no more than bf16 noise (mean |dlogit| at most
    BF16_NOISE)."""
    invariant, specs, alone, batched, la, lb = alone_vs_batch
    if invariant and target[1] == "cuda":
        assert la.keys() == lb.keys()
        assert [k for k in la if not np.array_equal(la[k], lb[k])] == []
    bad, noise = [], []
    for i, (p, sp) in enumerate(specs):
        if sp.temperature != 0 or alone[i] == batched[i]:
            continue
        if target[1] != "cuda" or invariant:
            bad.append(i)
            continue
        noise.append((i, *_first_flip(p, alone[i], batched[i], la, lb)))
        if not noise[-1][2] <= BF16_NOISE:
            bad.append(noise[-1])
    print("greedy divergences (request, index, mean|dlogit|, max|dlogit|, margin alone, margin batched):", noise)
    assert bad == []


def test_seeded_sampling_ignores_batch_neighbours(target, alone_vs_batch):
    invariant, specs, alone, batched, _, _ = alone_vs_batch
    bad = [i for i, (_, sp) in enumerate(specs) if sp.temperature != 0 and alone[i] != batched[i]]
    if bad and target[1] == "cuda" and not invariant:
        # The sampler draws the same uniforms whatever the batch; the logits are what differ: cublasLt
        # picks its algorithm by M and attention splits by batch size, so bf16 logits move by ~1e-2
        # between batch shapes and a draw near a CDF boundary flips. Not bitwise batch-invariant (nor is
        # vLLM by default); the NumPy backend is, and is held to it.
        pytest.xfail(f"GPU logits are batch-shape dependent in the last bits; seeded requests {bad} differ")
    assert bad == []


@pytest.mark.parametrize("budget,capped", [(5, False), (16, False), (33, False), (16, True), (33, True)])
def test_chunked_prefill_matches_unchunked(target, target_llm, budget, capped):
    """A 70-token prompt cut into chunks of `budget` tokens beside a decoding request gives the tokens of
    the prompt computed in one piece, alone: exactly on the NumPy backend; on the GPU by default up to a
    greedy flip within bf16 noise (see test_greedy_alone_equals_inside_mixed_batch: a 33-token chunk and
    the 70-token prompt run cublasLt GEMMs whose algorithm is chosen by timing, gemm.py's TUNE_M), which a
    chunk that lost or corrupted its state handoff would exceed. capped: the chunks come from
    prefill_budget_with_decodes instead of the step budget (on the GPU they replay the small mixed steps'
    CUDA graphs, gpu/decode_graph.py)."""
    p, sp = prompt(99, 70), SamplingParams(max_tokens=6, **GREEDY)
    la, lb = {}, {}
    target_llm.engine.runner.logits_hook = _record_greedy_logits(la)
    try:
        want = target_llm.generate([p], sp)[0].token_ids
    finally:
        target_llm.engine.runner.logits_hook = None
    eng, col = make(target, max_num_seqs=4, **({"max_num_batched_tokens": 256, "prefill_budget_with_decodes": budget}
                                               if capped else {"max_num_batched_tokens": budget}))
    eng.runner.logits_hook = _record_greedy_logits(lb)
    other = (prompt(1, 9), SamplingParams(max_tokens=20, **GREEDY))  # decodes alongside
    if capped:  # its prefill first, alone: the cap applies beside its decodes
        r1 = eng.submit(*other, col)
        eng.step()
        r0 = eng.submit(p, sp, col)
    else:
        r0, r1 = eng.submit(p, sp, col), eng.submit(*other, col)
    drive(eng, col, [r0, r1])
    if capped and target[1] == "cuda":
        assert eng.runner.graphs.mixed is not None and any(k < 0 for _, k in eng.runner.graphs.graphs)
    eng.shutdown()
    if target[1] != "cuda":
        assert col.tokens(r0) == want
    else:
        flip = _first_flip(p, want, col.tokens(r0), la, lb)
        print("greedy divergence (index, mean|dlogit|, max|dlogit|, margins):", flip)
        assert flip is None or flip[1] <= BF16_NOISE, flip


@pytest.mark.parametrize("budget", [132, 200])
def test_invariant_chunked_prefill_matches_unchunked(target, budget):
    """batch_invariant: a 300-token prompt cut at multiples of 64 beside a decoding request gives the
    tokens (and, on the GPU, the logits bit for bit) of the prompt computed in one piece, alone."""
    p, sp = prompt(98, 300), SamplingParams(max_tokens=6, **GREEDY)
    la, lb = {}, {}
    eng, col = make(target, max_num_seqs=4, max_num_batched_tokens=512, batch_invariant=True)
    eng.runner.logits_hook = _record_greedy_logits(la)
    want = eng.submit(p, sp, col)
    drive(eng, col, [want])
    eng.shutdown()
    eng, col2 = make(target, max_num_seqs=4, max_num_batched_tokens=budget, batch_invariant=True)
    eng.runner.logits_hook = _record_greedy_logits(lb)
    r1 = eng.submit(prompt(1, 9), SamplingParams(max_tokens=20, **GREEDY), col2)  # decodes alongside
    eng.step()
    r0 = eng.submit(p, sp, col2)
    drive(eng, col2, [r0, r1])
    eng.shutdown()
    assert col2.tokens(r0) == col.tokens(want)
    if target[1] == "cuda":
        assert all(np.array_equal(la[k], lb[k]) for k in la)


def test_batch_invariant_flag_and_budget_check(tiny_dir):
    """--batch-invariant reaches the engine; a budget too small for 64-token chunks beside every decode
    is refused with the numbers."""
    import argparse

    from server.cli import _add_engine_args, engine_kwargs
    ap = argparse.ArgumentParser()
    _add_engine_args(ap)
    assert engine_kwargs(ap.parse_args(["--batch-invariant"]))["batch_invariant"] is True
    assert "batch_invariant" not in engine_kwargs(ap.parse_args([]))
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(100\) must be at least max_num_seqs \(16\) \+ 128"):
        Engine(tiny_dir, start=False, device="cpu", batch_invariant=True, max_num_seqs=16, max_num_batched_tokens=100)


def test_llm_generate_forms(llm):
    outs = llm.generate(["hello", [1, 2, 3]], SamplingParams(max_tokens=3, **GREEDY))
    assert [len(o.token_ids) for o in outs] == [3, 3] and all(o.finish_reason == "length" for o in outs)
    assert isinstance(outs[0].text, str) and outs[1].prompt_token_ids == [1, 2, 3]
    assert llm.generate("hello", SamplingParams(max_tokens=3, **GREEDY))[0].token_ids == outs[0].token_ids
    o = llm.generate([[5, 6]], SamplingParams(max_tokens=2, logprobs=3, **GREEDY))[0]
    assert len(o.logprobs) == 2 and all(len(lp.top_logprobs) == 3 for lp in o.logprobs)
    assert o.logprobs[0].token_id == o.token_ids[0] and o.logprobs[0].logprob <= 0


def test_generation_config_defaults_apply(tiny_dir):
    eng, col = make(tiny_dir)
    rid = eng.submit([1, 2], SamplingParams(max_tokens=1), col)
    eng.step(block=False)  # prefill and sampling launched; the token is delivered by the next step
    eng.step(block=False)
    assert col.last(rid).finished
    p = SamplingParams().with_defaults(eng.cfg.sampling_defaults)
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 20)


@pytest.mark.parametrize("phase", ["waiting", "prefill", "decode"])
def test_abort_returns_blocks_and_slots(target, phase):
    eng, col = make(target, max_num_seqs=2, max_num_batched_tokens=8)
    init = eng.stats()
    other = [eng.submit(prompt(5, 4), SamplingParams(max_tokens=30, **GREEDY), col) for _ in range(2)]
    eng.step()  # the two others run; the next one waits (max_num_seqs 2)
    if phase == "waiting":
        rid = eng.submit(prompt(6, 20), SamplingParams(max_tokens=5), col)
        eng.step()
        assert eng.stats().waiting == 1
    else:
        for r in other:
            eng.abort(r)
        eng.step()
        rid = eng.submit(prompt(6, 30), SamplingParams(max_tokens=50), col)
        eng.step()  # first 8-token chunk of 30
        assert eng.stats().running == 1
        if phase == "decode":
            for _ in range(5):
                eng.step()
            assert 0 < len(col.tokens(rid)) < 50
        else:
            assert rid not in col.events
    eng.abort(rid)
    eng.step()
    assert col.last(rid).finished and col.last(rid).finish_reason == "abort"
    for r in other:
        eng.abort(r)
    eng.step()
    st = eng.stats()
    assert (st.kv_blocks_free, st.state_slots_free, st.running, st.waiting) == \
           (init.kv_blocks_free, init.state_slots_free, 0, 0)
    assert st.finished["abort"] >= 2


def test_admission_rejection_and_deferral(tiny_dir):
    eng, col = make(tiny_dir, max_model_len=64, num_kv_blocks=5, block_size=16, max_waiting_requests=2)
    with pytest.raises(AdmissionError, match=r"maximum context length is 64.*70 tokens \(60 in the prompt, 10 max"):
        eng.submit(prompt(0, 60), SamplingParams(max_tokens=10), col)
    with pytest.raises(AdmissionError, match=r"65 tokens.*50 in the prompt, 15 max tokens.*holds 64 tokens"):
        make(tiny_dir, max_model_len=100, num_kv_blocks=5)[0].submit(prompt(0, 50), SamplingParams(max_tokens=15), col)
    a = eng.submit(prompt(1, 30), SamplingParams(max_tokens=10, **GREEDY), col)  # 3 of 4 blocks
    b = eng.submit(prompt(2, 20), SamplingParams(max_tokens=10, **GREEDY), col)  # needs 2: waits
    with pytest.raises(OverloadedError, match="queue is full"):
        eng.submit(prompt(3, 4), SamplingParams(max_tokens=1), col)
    eng.step()
    assert eng.stats().running == 1 and eng.stats().waiting == 1 and b not in col.events
    drive(eng, col, [a, b])
    assert len(col.tokens(b)) == 10
    st = eng.stats()
    assert st.num_rejected == 1 and st.num_overloaded == 1 and st.kv_blocks_used == 0
    with pytest.raises(ValueError, match="logprobs"):
        eng.submit([1], SamplingParams(logprobs=21), col)
    with pytest.raises(ValueError, match="logit_bias"):
        eng.submit([1], SamplingParams(logit_bias={10 ** 7: 1.0}), col)


def test_eos_min_tokens_ignore_eos_and_stop_ids(tiny_dir, llm):
    force_eos = {EOS_IDS[0]: 100.0}
    o = llm.generate([[1, 2]], SamplingParams(max_tokens=5, logit_bias=force_eos, **GREEDY))[0]
    assert o.token_ids == [EOS_IDS[0]] and (o.finish_reason, o.stop_reason, o.text) == ("stop", None, "")
    o = llm.generate([[1, 2]], SamplingParams(max_tokens=5, min_tokens=3, logit_bias=force_eos, **GREEDY))[0]
    assert len(o.token_ids) == 4 and EOS_IDS[0] not in o.token_ids[:3] and o.finish_reason == "stop"
    o = llm.generate([[1, 2]], SamplingParams(max_tokens=5, ignore_eos=True, logit_bias=force_eos, **GREEDY))[0]
    assert o.token_ids == [EOS_IDS[0]] * 5 and o.finish_reason == "length"
    base = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=8, **GREEDY))[0].token_ids
    o = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=8, stop_token_ids=[base[3]], **GREEDY))[0]
    k = base.index(base[3])
    assert o.token_ids == base[:k + 1] and (o.finish_reason, o.stop_reason) == ("stop", base[3])


def test_stop_strings(tiny_dir):
    eng, col = make(tiny_dir)
    # one token per letter, forced in order through the logits hook, gives a known text
    seq = [eng.tokenizer.encode(c)[0] for c in "abcdefgh"]

    def run(**kw):
        rid = eng.submit([1], SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY, **kw), col)

        def hook(reqs, logits):
            for j, r in enumerate(reqs):
                if r.request_id == rid:
                    logits[j, seq[len(r.output_ids)]] += 1000.0
            return logits
        eng.runner.logits_hook = hook
        drive(eng, col, [rid])
        return rid

    rid = run()
    assert col.text(rid) == "abcdefgh"
    rid = run(stop=["xyz", "def"])
    assert col.text(rid) == "abc" and col.last(rid).finish_reason == "stop" and col.last(rid).stop_reason == "def"
    assert col.tokens(rid) == seq[:6]
    assert all("d" not in e.new_text for e in col.events[rid])  # partial stop text never leaked
    rid = run(stop=["def"], include_stop_str_in_output=True)
    assert col.text(rid) == "abcdef"
    rid = run(stop=["gh!"])                      # never matches: the held-back tail is flushed at the end
    assert col.text(rid) == "abcdefgh" and col.last(rid).finish_reason == "length"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_buffer_across_deltas(include):
    from engine.request import StopStringBuffer
    for deltas in (["ab", "cST", "OPx"], ["a", "b", "c", "S", "T", "O", "P"], ["abcSTOPx"], ["abcS", "TO", "Px"]):
        buf, out, hit = StopStringBuffer(["STOP", "zz"], include), "", None
        for d in deltas:
            text, hit = buf.feed(d)
            assert "S" not in text or include
            out += text
            if hit:
                break
        assert hit == "STOP" and out == ("abcSTOP" if include else "abc"), deltas
    buf = StopStringBuffer(["STOP"], False)
    assert buf.feed("xxST") == ("x", None) and buf.flush() == "xST"


def test_fault_isolation_bad_row_and_failed_step(tiny_dir):
    eng, col = make(tiny_dir)
    rids = [eng.submit(prompt(i, 5), SamplingParams(max_tokens=4, **GREEDY), col) for i in range(3)]
    bad = rids[1]

    def nan_row(reqs, logits):
        for j, r in enumerate(reqs):
            if r.request_id == bad:
                logits[j, 3] = np.nan
        return logits
    eng.runner.logits_hook = nan_row
    drive(eng, col, rids)
    assert col.last(bad).finish_reason == "error" and "non-finite" in col.last(bad).error
    assert [col.last(r).finish_reason for r in (rids[0], rids[2])] == ["length", "length"]

    calls = {"n": 0}

    def boom(reqs, logits):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return logits
    eng.runner.logits_hook = boom
    rids = [eng.submit(prompt(i, 5), SamplingParams(max_tokens=4, **GREEDY), col) for i in range(2)]
    eng.step()
    for r in rids:
        assert col.last(r).finish_reason == "error" and f"request {r}" in col.last(r).error
        assert "injected" in col.last(r).error
    st = eng.stats()
    assert st.kv_blocks_used == 0 and st.state_slots_free == st.state_slots_total
    r = eng.submit(prompt(9, 5), SamplingParams(max_tokens=3, **GREEDY), col)  # still serving
    drive(eng, col, [r])
    assert col.last(r).finish_reason == "length"


def test_bad_params_and_detokenizer_failure_end_one_request(tiny_dir):
    eng, col = make(tiny_dir)
    a, b, c = (eng.submit(prompt(i, 5), SamplingParams(max_tokens=4, **GREEDY), col) for i in range(3))
    eng.step()
    eng._requests[a].params.logit_bias = {10 ** 7: 1.0}  # slipped past validation

    class Broken:
        def add(self, t):
            raise UnicodeError("broken")
    eng._requests[b].detokenizer = Broken()
    drive(eng, col, [a, b, c])
    assert col.last(a).finish_reason == "error" and "logit_bias" in col.last(a).error
    assert col.last(b).finish_reason == "error" and "detokeniz" in col.last(b).error
    assert col.last(c).finish_reason == "length" and len(col.tokens(c)) == 4
    assert eng.stats().kv_blocks_used == 0


async def _consume(stream):
    async for o in stream:
        pass


def test_async_interface_streams_and_aborts(tiny_dir):
    eng = Engine(tiny_dir, device="cpu")

    async def main():
        deltas = [o async for o in eng.add_request([1, 2, 3], SamplingParams(max_tokens=5, **GREEDY))]
        it = eng.add_request([4, 5], SamplingParams(max_tokens=200, ignore_eos=True, **GREEDY))
        async for o in it:
            break
        await it.aclose()  # client gone: aborts
        t = asyncio.ensure_future(_consume(eng.add_request([6], SamplingParams(max_tokens=300, ignore_eos=True))))
        await asyncio.sleep(0.05)
        t.cancel()  # a cancelled handler task aborts too
        with pytest.raises(asyncio.CancelledError):
            await t
        for _ in range(200):
            if eng.stats().running == 0:
                break
            await asyncio.sleep(0.01)
        return deltas

    deltas = asyncio.run(main())
    assert [len(d.new_token_ids) for d in deltas] == [1] * 5 and deltas[-1].finished
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 5 and deltas[-1].prompt_tokens == 3
    st = eng.stats()
    assert st.running == 0 and st.kv_blocks_used == 0 and st.finished.get("abort") == 2
    assert st.generation_tokens >= 6 and st.prompt_tokens == 6
    eng.shutdown()


def test_dead_loop_is_detectable(tiny_dir):
    eng = Engine(tiny_dir, device="cpu")
    col = Collect()

    def die():
        raise SystemError("scheduler bug")
    eng.scheduler.schedule = die
    rid = eng.submit([1, 2], SamplingParams(max_tokens=2), col)
    eng._thread.join(timeout=10)
    assert not eng.is_alive() and isinstance(eng.dead, SystemError)
    assert col.last(rid).finish_reason == "error" and "died" in col.last(rid).error
    with pytest.raises(EngineDeadError):
        eng.submit([1], SamplingParams(), col)


def test_shutdown_ends_outstanding_requests(tiny_dir):
    eng = Engine(tiny_dir, device="cpu", max_num_batched_tokens=32)
    col = Collect()
    rid = eng.submit([1, 2], SamplingParams(max_tokens=2000, ignore_eos=True), col)
    eng.shutdown()
    assert col.last(rid).finished and "shut down" in col.last(rid).error


def test_step_trace(tiny_dir, tmp_path):
    import json
    path = tmp_path / "steps.jsonl"
    eng, col = make(tiny_dir, max_num_seqs=4, max_num_batched_tokens=16, trace_steps=str(path))
    a = eng.submit(prompt(1, 5), SamplingParams(max_tokens=6, **GREEDY), col)
    eng.step()
    b = eng.submit(prompt(2, 40), SamplingParams(max_tokens=2, **GREEDY), col)  # chunks while a decodes
    drive(eng, col, [a, b])
    c = eng.submit(prompt(3, 40), SamplingParams(max_tokens=1, **GREEDY), col)  # alone: 16, 16, 8 tokens
    drive(eng, col, [c])
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    assert [s["prefill_tokens"] for s in steps[-3:]] == [16, 16, 8]  # steps that sample nothing count too
    assert steps[0]["kind"] == "prefill" and steps[0]["prefill_tokens"] == 5
    mixed = [s for s in steps if s["kind"] == "mixed"]
    assert mixed and all(s["decode_rows"] == 1 and 0 < s["prefill_tokens"] <= 15 for s in mixed)
    assert steps[-4]["kind"] == "decode"
    keys = ("schedule_ms", "launch_ms", "sample_ms", "wait_ms", "deliver_ms", "gpu_ms", "step_ms", "idle_ms")
    assert all(s[k] >= 0 for s in steps for k in keys)
    assert all(s["gpu_ms"] > 0 and s["step_ms"] >= s["launch_ms"] for s in steps)
    assert [s["t"] for s in steps] == sorted(s["t"] for s in steps)


# ---- the device one step ahead: paths around a step in flight ------------------------------------
def _lines(path):
    import json
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_shutdown_delivers_the_step_in_flight(tiny_dir, tmp_path):
    path = tmp_path / "steps.jsonl"
    eng, col = make(tiny_dir, trace_steps=str(path))
    rid = eng.submit(prompt(1, 5), SamplingParams(max_tokens=2, **GREEDY), col)
    eng.step()
    eng.step()  # the first token delivered; the second sampled, still in flight
    assert len(col.tokens(rid)) == 1 and not col.last(rid).finished
    eng._stop = True
    eng._loop()  # what the loop thread does once shutdown() is called
    assert col.last(rid).finish_reason == "length" and len(col.tokens(rid)) == 2
    assert len(_lines(path)) == 2


def test_failed_forward_with_a_step_in_flight(tiny_dir, llm, tmp_path):
    path = tmp_path / "steps.jsonl"
    eng, col = make(tiny_dir, trace_steps=str(path))
    a = eng.submit(prompt(1, 5), SamplingParams(max_tokens=6, **GREEDY), col)
    eng.step()  # a's first token in flight

    def boom(batch, prev, plan=None):
        raise RuntimeError("injected forward failure")
    real, eng.runner.forward = eng.runner.forward, boom
    eng.step()  # a's decode fails: a ends with the error; its token in flight is dropped
    eng.runner.forward = real
    assert col.last(a).finish_reason == "error" and "injected forward failure" in col.last(a).error
    assert col.tokens(a) == []
    st = eng.stats()
    assert st.kv_blocks_used == 0 and st.state_slots_free == st.state_slots_total and st.running == 0
    p = prompt(2, 9)
    b = eng.submit(p, SamplingParams(max_tokens=4, **GREEDY), col)  # still serving, in a's slot
    drive(eng, col, [b])
    assert col.tokens(b) == llm.generate([p], SamplingParams(max_tokens=4, **GREEDY))[0].token_ids
    lines = _lines(path)
    assert [("error" in s) for s in lines[:2]] == [False, True] and "injected" in lines[1]["error"]


def test_abort_with_a_token_in_flight_frees_the_slot_for_the_next(tiny_dir, llm):
    eng, col = make(tiny_dir, max_num_seqs=1)
    a = eng.submit(prompt(3, 5), SamplingParams(max_tokens=50, **GREEDY), col)
    eng.step()
    eng.step()  # a decoding, a token in flight
    p = prompt(4, 7)
    b = eng.submit(p, SamplingParams(max_tokens=4, **GREEDY), col)  # waits (max_num_seqs 1)
    eng.abort(a)
    drive(eng, col, [a, b])  # next step: a aborted, b admitted into its slot and blocks
    assert col.last(a).finish_reason == "abort" and len(col.tokens(a)) == 1
    assert col.tokens(b) == llm.generate([p], SamplingParams(max_tokens=4, **GREEDY))[0].token_ids
