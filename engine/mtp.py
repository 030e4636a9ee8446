"""The MTP drafter: the multi-token-prediction head that every Qwen3.5 checkpoint carries (spec-decode-spec.md
§1; `--speculative-config '{"method": "mtp", ...}'`).

For the pair (h_p, t) at position p, h_p the target's post-norm hidden (the lm_head's input) and t the token at
p + 1, the head computes u = fc @ [RMS1p(E[t]); RMS1p(h_p)] (embedding first; fc split into its two halves,
so no concat), one full-attention decoder layer of the target's kind at RoPE position p, g = mtp.norm(y), and
the target's lm_head on g scores the token at p + 2. Written against the op interface (ops.py), with the
model's own attention and MLP code, so it runs on every backend.

- observe(): the "first pass" over the rows the target just committed (row p gets token x_{p+1}: known on the
  host, or for a sampled request's last row of a step observed before it is collected the token the step
  samples, fed on the device), one batched step for all requests; it writes the head's KV at those
  positions and keeps, per request, g at its last committed row.
- propose(): d_1 = argmax(lm_head(g)); each further draft chains (d_s, g) at the next position, batched across
  requests per chain step; the drafts come to the host once, at the end.

Its KV is one more full-attention layer of the target's paged cache (Qwen35Model.draft_kv_layers: the same
blocks, the request's own block table, counted in the memory plan). It needs no rollback: entries past what
the target committed are rewritten by the next first pass before anything reads them.
"""
from __future__ import annotations

import numpy as np

from .arrays import array_module, as_f32, to_numpy
from .config import FULL
from .drafter import Drafter, StepRecord
from .model import Capture, Qwen35Model, layer_weights
from .request import Request
from .step import Step


class MtpDrafter(Drafter):
    def __init__(self, model: Qwen35Model, weights: dict, *, embedding_first: bool = True, post_norm: bool = True,
                 norms_1p: bool = True):
        """model: the target (with draft_kv_layers 1: its cache has the head's KV); weights: with the mtp.* tensors.
        The keyword arguments build the wrong variants that the tests' negative controls need (spec §4 item
        4): the concat order swapped, the target's pre-norm hidden (the residual stream after its last
        layer) fed, and plain RMSNorm(x) * w for the head's three own norms."""
        cfg = model.cfg
        assert model.draft_kv_layers == 1, "the target's cache needs a KV layer for the MTP head"
        self.model, self.ops, self.eps = model, model.ops, cfg.rms_norm_eps
        self.cache = self.k = self.v = None  # bind()
        up, H = model.ops.weight, cfg.hidden_size

        def norm(w):  # the ops' norms scale by (1 + w): plain RMS(x) * w is RMS1p(x; w - 1)
            return w if norms_1p else as_f32(w) - 1
        fc = weights["mtp.fc.weight"]
        halves = [up(np.ascontiguousarray(fc[:, :H])), up(np.ascontiguousarray(fc[:, H:]))]
        self.fc_embed, self.fc_hidden = halves if embedding_first else halves[::-1]
        self.norm_embed = up(norm(weights["mtp.pre_fc_norm_embedding.weight"]))
        self.norm_hidden = up(norm(weights["mtp.pre_fc_norm_hidden.weight"]))
        self.norm = up(norm(weights["mtp.norm.weight"]))
        self.layer = layer_weights(model.ops, lambda name: weights[f"mtp.layers.0.{name}"], FULL)
        self.capture = Capture(post_norm=True) if post_norm else Capture(taps=(cfg.num_layers - 1,))
        self._key = "post_norm" if post_norm else "taps"
        self._last: dict[Request, tuple] = {}  # request -> (g rows, its row, position): at its last committed row

    def bind(self, cache) -> None:
        self.cache = cache
        self.k, self.v = cache.k[len(self.model.cfg.full_layers)], cache.v[len(self.model.cfg.full_layers)]

    def weight_bytes(self) -> int:
        arrays = [self.fc_embed, self.fc_hidden, self.norm_embed, self.norm_hidden, self.norm]
        return sum(a.nbytes for a in arrays + [v for v in self.layer.values() if hasattr(v, "nbytes")])

    def observe(self, record: StepRecord) -> None:
        done = record.committed()
        if not done:
            return
        chunks, rows, fed, src = [], [], [], []
        for req, base, first, n in done:
            ids = req.token_ids(base + 1, base + n + 1)  # shifted left by one: row p gets x_{p+1}
            if len(ids) == n - 1:  # its last row's x_{p+1} is what the step samples: fed on the device
                assert record.sampled is not None and req in record.sampled[0], (req.request_id, base, n)
                fed.append(len(rows) + n - 1)
                src.append(record.sampled[0][req])
                ids.append(0)
            assert len(ids) == n, (req.request_id, base, n)
            chunks.append((ids, base, req.slot, req.block_ids))
            rows.extend(range(first, first + n))
        hidden = self.ops.gather_rows(record.captured[self._key], np.array(rows, np.int32))
        feed = None
        if fed:
            tokens = record.sampled[1]
            feed = (np.array(fed, np.int64), tokens[array_module(tokens).asarray(np.array(src, np.int64))])
        g = self._forward(Step.build(chunks, feed=feed), hidden)
        for i, (req, base, _, n) in enumerate(done):
            self._last[req] = (g, i, base + n - 1)

    def propose(self, reqs: list[Request], rooms: list[int]) -> list[list[int]]:
        return self.draft(reqs, rooms)[0]

    def forget(self, req: Request) -> None:
        self._last.pop(req, None)

    def draft(self, reqs: list[Request], rooms: list[int]) -> tuple[list[list[int]], list[tuple[list[int], object]]]:
        """(drafts per request, per chain step (the requests' indices, their logits [n, V] f32 on the device)).
        A request gets none when its last committed row has not been observed."""
        ops, m = self.ops, self.model
        live = [i for i, (req, k) in enumerate(zip(reqs, rooms))
                if k > 0 and req in self._last and self._last[req][2] == req.num_computed - 1]
        out: list[list[int]] = [[] for _ in reqs]
        if not live:
            return out, []
        g, pos = self._stored([reqs[i] for i in live]), [self._last[reqs[i]][2] for i in live]
        steps = []
        for s in range(max(rooms[i] for i in live)):
            logits = as_f32(ops.linear(g, m.lm_head))
            tokens = ops.argmax_finite(logits)[:, 0]
            steps.append((live, logits, tokens))
            more = [j for j, i in enumerate(live) if rooms[i] > s + 1]
            if not more:
                break
            if len(more) < len(live):
                sub = np.array(more, np.int32)
                g, tokens = ops.gather_rows(g, sub), tokens[array_module(tokens).asarray(sub)]
                live, pos = [live[j] for j in more], [pos[j] for j in more]
            # (d_{s+1}, g) at position p + 1 + s: the pair's position is its hidden's (spec §1.3)
            step = Step.build([([0], p + 1 + s, reqs[i].slot, reqs[i].block_ids) for i, p in zip(live, pos)],
                              feed=(np.arange(len(live)), tokens))
            g = self._forward(step, g)
        for idx, _, tokens in steps:  # one wait for the device, at the first copy
            for i, t in zip(idx, to_numpy(tokens).tolist()):
                out[i].append(int(t))
        return out, [(idx, logits) for idx, logits, _ in steps]

    def _forward(self, step: Step, hidden):
        """The head over the step's tokens with one hidden row each: writes its KV at their positions and
        returns g = mtp.norm(y) at each sequence's last row (step.logits_rows) [B, H]."""
        ops, m, L, eps = self.ops, self.model, self.layer, self.eps
        meta = ops.prepare(step, self.cache)
        e, _ = ops.add_rms_norm(ops.embed(m.embed, meta), None, self.norm_embed, eps)
        h, _ = ops.add_rms_norm(hidden, None, self.norm_hidden, eps)
        # the layer's input norm adds the two halves' products: u = fc @ [e; h] without a concat
        x, u = ops.add_rms_norm(ops.linear(e, self.fc_embed), ops.linear(h, self.fc_hidden), L["ln1"], eps)
        h, residual = ops.linear_add_rms_norm(m.attention(L, x, meta, self.k, self.v), L["o_proj"], u, L["ln2"], eps)
        x = ops.linear(ops.swiglu(h, L["gate_up"]), L["down"])
        rows = step.logits_rows
        g, _ = ops.add_rms_norm(ops.gather_rows(x, rows), ops.gather_rows(residual, rows), self.norm, eps)
        return g

    def _stored(self, reqs: list[Request]):
        """The requests' kept g rows as one [n, H] array (one gather when they come from one observe, as
        when every running request was in the last step)."""
        kept = [self._last[req] for req in reqs]
        if len({id(g) for g, _, _ in kept}) == 1:
            return self.ops.gather_rows(kept[0][0], np.array([row for _, row, _ in kept], np.int32))
        return array_module(kept[0][0]).concatenate([g[row:row + 1] for g, row, _ in kept])
