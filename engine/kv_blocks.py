"""Paged KV block manager for the full-attention layers: a free list of page ids.

Block size 16 (default): requests reserve their whole lifetime up front, so the only waste is
the last partial page (< 16 tokens per request); 16 keys is one tensor-core MMA K-tile for the
attention kernels; and there is no prefix cache whose hit granularity would argue for big pages.
Page 0 is a dummy (CUDA-graph padding rows and unused block-table entries point at it).
"""
from __future__ import annotations

DUMMY_BLOCK = 0


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (one is the dummy page), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, DUMMY_BLOCK, -1))  # pop() hands out low ids first

    @property
    def capacity(self) -> int:
        """Blocks usable by requests (all but the dummy)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked for {n} blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
