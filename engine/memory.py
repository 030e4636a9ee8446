"""The start-up memory plan: how many GDN state slots, state snapshots and KV blocks the cache gets.

State slots (one per sequence + the dummy) are reserved first; KV gets what the budget leaves, but
never more blocks than max_num_seqs sequences of max_model_len could use at once. The budget is
`kv_cache_memory` when given, else the backend's (`Backend.cache_budget`: on the GPU what
gpu_memory_utilization leaves after the weights and one step's activations).

With prefix caching the snapshot pool (rows of the same state arrays, after the slots) comes next,
`num_state_snapshots` or state_snapshots.default_num_snapshots of the memory the running set's KV
leaves, and the KV blocks then take all the rest: past what running sequences can use, a block is a
cached prefix.

With speculative decoding (k drafts per verify) each speculating sequence needs a log set (1 + k entries
of what a verify's tokens change in the GDN state, Cache.conv_log / rec_log; state_slots.SpecLogPool; 12.2 MiB
for the 4B at k = 3, where a state slot is 49.1 MiB): max_num_seqs sets when they fit in half the budget the
slots leave (or, with num_kv_blocks given, in what those blocks leave), else as many as fit there (a
request admitted without a set runs without speculation), plus one for CUDA graphs' padding. The step reserve counts a verify's logits rows,
1 + k per sequence. The MTP drafter's KV is one more attention layer of every block
(Qwen35Model.draft_kv_layers): the blocks are that much bigger, so fewer fit. The DFlash drafter keeps its
own paged KV (dflash.py): its bytes per block are added likewise, its fixed scratch pages come off the
budget.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import EngineArgs
from .state_snapshots import default_num_snapshots


@dataclass
class CachePlan:
    num_slots: int
    num_blocks: int
    slot_bytes: int
    block_bytes: int
    num_snapshots: int = 0    # state rows after the slots (prefix caching), each slot_bytes
    num_spec_logs: int = 0    # speculative decoding: log sets (and one more for padding), each spec_log_bytes
    spec_tokens: int = 0
    spec_log_bytes: int = 0
    draft_kv_layers: int = 0  # attention layers of each KV block that are a drafter's (MTP: 1), in block_bytes

    @property
    def num_rows(self) -> int:
        """State rows the cache is allocated with: slots, then snapshots."""
        return self.num_slots + self.num_snapshots

    def describe(self, backend_name: str, weight_bytes: int, a: EngineArgs) -> str:
        gib, mib = 1 / (1 << 30), 1 / (1 << 20)
        caching = (f"prefix caching: {self.num_snapshots} state snapshots x {self.slot_bytes * mib:.1f} MiB = "
                   f"{self.num_snapshots * self.slot_bytes * gib:.2f} GiB" if a.enable_prefix_caching
                   else "prefix caching off")
        if self.spec_tokens:
            caching += (f"; speculative decoding: log sets for {self.num_spec_logs} of {a.max_num_seqs} sequences x "
                        f"{self.spec_log_bytes * mib:.1f} MiB = {self.num_spec_logs * self.spec_log_bytes * gib:.2f} GiB")
        if self.draft_kv_layers:
            caching += f"; each KV block holds {self.draft_kv_layers} drafter attention layer(s) too"
        return (f"memory plan ({backend_name}): weights {weight_bytes * gib:.2f} GiB; step activations for "
                f"{a.max_num_batched_tokens} tokens; {self.num_slots} state slots x {self.slot_bytes * mib:.1f} MiB "
                f"= {self.num_slots * self.slot_bytes * gib:.2f} GiB; {self.num_blocks} KV blocks x {a.block_size} "
                f"tokens = {self.num_blocks * self.block_bytes * gib:.2f} GiB; {caching}")


def unit_bytes(model, block_size: int, spec_tokens: int = 0) -> tuple[int, int, int]:
    """Bytes of one state slot, of one KV block and of one log set of 1 + spec_tokens entries (0 without),
    measured on a 1-slot, 1-block cache so the backend's own dtypes and layouts count."""
    probe = model.alloc_cache(1, 1, block_size, 1 if spec_tokens else 0, spec_tokens)
    return (sum(x.nbytes for x in probe.conv + probe.rec), sum(x.nbytes for x in probe.k + probe.v),
            sum(x.nbytes for x in probe.conv_log + probe.rec_log))


def plan_cache(model, a: EngineArgs, max_model_len: int, spec_tokens: int = 0, drafter=None) -> CachePlan:
    """spec_tokens: speculative decoding's drafts per verify (0: off); drafter: its own KV (Drafter.kv_bytes)."""
    num_slots = a.max_num_seqs + 1
    slot_bytes, block_bytes, log_bytes = unit_bytes(model, a.block_size, spec_tokens)
    draft_block, draft_fixed = drafter.kv_bytes(a.block_size) if drafter is not None else (0, 0)
    block_bytes += draft_block
    useful = a.max_num_seqs * -(-max_model_len // a.block_size) + 1  # what running sequences can use at once
    need_budget = a.num_kv_blocks is None or (a.enable_prefix_caching and a.num_state_snapshots is None)
    budget = a.kv_cache_memory
    if budget is None and need_budget:
        # its logits reserve is per sampled row: a verify samples 1 + spec_tokens rows of a sequence
        budget = model.ops.cache_budget(model.cfg, a.max_num_batched_tokens, a.max_num_seqs * (1 + spec_tokens),
                                        a.gpu_memory_utilization)
    if budget is not None:
        budget -= draft_fixed
    num_snapshots = 0
    running_kv = (a.num_kv_blocks if a.num_kv_blocks is not None else useful) * block_bytes
    num_sets = a.max_num_seqs if spec_tokens else 0
    if spec_tokens and budget is not None:  # what the given KV blocks leave, else at most half the rest
        room = budget - num_slots * slot_bytes - log_bytes  # (the padding's set)
        room = room - running_kv if a.num_kv_blocks is not None else room // 2
        num_sets = max(0, min(num_sets, room // log_bytes))
    logs = (num_sets + 1) * log_bytes if spec_tokens else 0
    if a.enable_prefix_caching:
        num_snapshots = a.num_state_snapshots
        if num_snapshots is None:
            spare = budget - num_slots * slot_bytes - logs - running_kv
            num_snapshots = default_num_snapshots(a.max_num_seqs, slot_bytes, spare)
        if num_snapshots < 0:
            raise ValueError(f"num_state_snapshots must be >= 0, got {num_snapshots}")
    num_blocks = a.num_kv_blocks
    if num_blocks is None:
        num_blocks = (budget - (num_slots + num_snapshots) * slot_bytes - logs) // block_bytes
        if not a.enable_prefix_caching:
            num_blocks = min(num_blocks, useful)
    return CachePlan(num_slots, int(num_blocks), slot_bytes, block_bytes, int(num_snapshots), int(num_sets),
                     spec_tokens, log_bytes, model.draft_kv_layers)
