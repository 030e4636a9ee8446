"""Paged KV block manager for the full-attention layers: a free list of page ids, reference counts,
and (with prefix caching) a table of full blocks by chain hash.

Block size 16 (default): requests reserve their whole lifetime up front, so the only waste is
the last partial page (< 16 tokens per request); 16 keys is one tensor-core MMA K-tile for the
attention kernels; and a prefix hit is a multiple of the GDN chunk (64 tokens, prefix_cache.py)
anyway, so bigger pages would not give finer hits.
Page 0 is a dummy (CUDA-graph padding rows and unused block-table entries point at it).

Prefix caching (prefix_cache.py drives it; without it no block ever has a hash and this is the plain
free list): a full block whose KV is computed is published under the chain hash of the tokens
[0, its end) (`chain_hashes`). Requests share it by reference count. A block freed to refcount 0
keeps its hash and stays findable in an LRU of cached free blocks: those count as free
(`num_free`), and `allocate` takes them, oldest first, only when the plain free list is empty.
A block is written only by the one request that allocated it, before it is published: only full,
computed blocks are published, so a request's partial last block is always private.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

DUMMY_BLOCK = 0
ROOT_HASH = b""  # the parent of the first block (what must also match, e.g. a cache salt, would go here)


def chain_hashes(token_ids: list[int], block_size: int, parent: bytes = ROOT_HASH) -> list[bytes]:
    """The chain hash of each full block of token_ids: h_i = blake2b(h_{i-1} || block i's ids as int32).

    A block's hash names every token before its end, so equal hashes mean equal KV (a token's K/V
    depends on it and every token before it). blake2b, not Python's hash(): 128 bits make an
    accidental collision negligible, a crafted one (a prompt reading another user's KV, vLLM's
    CVE-2025-25183 with hash()) infeasible, and the value is the same in every process. About
    0.5 ms for 4096 tokens, once per request."""
    out = []
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.blake2b(parent + array("i", token_ids[i:i + block_size]).tobytes(), digest_size=16).digest()
        out.append(parent)
    return out


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (one is the dummy page), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, DUMMY_BLOCK, -1))  # pop() hands out low ids first
        self._ref = [0] * num_blocks
        self._hash: dict[int, bytes] = {}           # published block -> its chain hash
        self._by_hash: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # refcount 0 and published: LRU, oldest first

    @property
    def capacity(self) -> int:
        """Blocks usable by requests (all but the dummy)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: the free list plus cached blocks no request holds."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    @property
    def num_cached(self) -> int:
        """Published blocks (held by requests or not)."""
        return len(self._hash)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """n private blocks (refcount 1, no hash): the free list first, then the oldest cached free blocks."""
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._cached.popitem(last=False)
                del self._by_hash[self._hash.pop(b)]
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drops one reference to each block. A published block at refcount 0 stays cached; the tail of a
        request's chain is queued for eviction before its head (the head is the more widely shared)."""
        plain = []
        for b in reversed(blocks):
            assert self._ref[b] > 0, f"block {b} freed twice"
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._hash:
                    self._cached[b] = None
                else:
                    plain.append(b)
        self._free.extend(plain)

    # ---- prefix caching ---------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest run of hashes[0:k] that are all published. No side effects."""
        out = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def num_idle(self, blocks: list[int]) -> int:
        """How many of these cached blocks no request holds (they count in num_free until shared)."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    def share(self, blocks: list[int]) -> list[int]:
        """Takes one reference to each cached block (an idle one leaves the eviction LRU). Returns blocks."""
        for b in blocks:
            assert b in self._hash, f"block {b} is not published"
            if self._ref[b] == 0:
                del self._cached[b]
            self._ref[b] += 1
        return list(blocks)

    def publish(self, block: int, h: bytes) -> bool:
        """Makes a computed full block findable under its chain hash. False (and the block stays private)
        when another block already holds that hash, or this one already has a hash."""
        assert self._ref[block] > 0, f"block {block} is not held"
        if h in self._by_hash or block in self._hash:
            return False
        self._hash[block], self._by_hash[h] = h, block
        return True

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def hash_of(self, block: int) -> bytes | None:
        return self._hash.get(block)
