"""The start-up memory plan: how many GDN state slots and KV blocks the cache gets.

State slots (one per sequence + the dummy) are reserved first; KV gets what the budget leaves, but
never more blocks than max_num_seqs sequences of max_model_len could use at once. The budget is
`kv_cache_memory` when given, else the backend's (`Backend.cache_budget`: on the GPU what
gpu_memory_utilization leaves after the weights and one step's activations).
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import EngineArgs


@dataclass
class CachePlan:
    num_slots: int
    num_blocks: int
    slot_bytes: int
    block_bytes: int

    def describe(self, backend_name: str, weight_bytes: int, a: EngineArgs) -> str:
        gib, mib = 1 / (1 << 30), 1 / (1 << 20)
        return (f"memory plan ({backend_name}): weights {weight_bytes * gib:.2f} GiB; step activations for "
                f"{a.max_num_batched_tokens} tokens; {self.num_slots} state slots x {self.slot_bytes * mib:.1f} MiB "
                f"= {self.num_slots * self.slot_bytes * gib:.2f} GiB; {self.num_blocks} KV blocks x {a.block_size} "
                f"tokens = {self.num_blocks * self.block_bytes * gib:.2f} GiB")


def unit_bytes(model, block_size: int) -> tuple[int, int]:
    """Bytes of one state slot and of one KV block, measured on a 1-slot, 1-block cache so the
    backend's own dtypes count."""
    probe = model.alloc_cache(1, 1, block_size)
    return sum(x.nbytes for x in probe.conv + probe.rec), sum(x.nbytes for x in probe.k + probe.v)


def plan_cache(model, a: EngineArgs, max_model_len: int) -> CachePlan:
    num_slots = a.max_num_seqs + 1
    slot_bytes, block_bytes = unit_bytes(model, a.block_size)
    num_blocks = a.num_kv_blocks
    if num_blocks is None:
        budget = a.kv_cache_memory
        if budget is None:
            budget = model.ops.cache_budget(model.cfg, a.max_num_batched_tokens, a.max_num_seqs,
                                            a.gpu_memory_utilization)
        useful = a.max_num_seqs * -(-max_model_len // a.block_size) + 1  # more could never be used at once
        num_blocks = min((budget - num_slots * slot_bytes) // block_bytes, useful)
    return CachePlan(num_slots, int(num_blocks), slot_bytes, block_bytes)
