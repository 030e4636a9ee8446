"""A bounded pool of GDN state snapshots: the conv + recurrent state of every GDN layer after some
token position, kept for prefix caching (prefix_cache.py says which positions and why).

A snapshot is a row of the same conv/rec state arrays as the slots: the cache is allocated with
num_slots + count rows, slots take ids [0, num_slots) and snapshots [first_id, first_id + count),
so saving and restoring are both one row copy, `copy_slots(cache, src_ids, dst_ids)`. This pool only
hands out ids; it never touches arrays.

An id is in one of four states:
    free       no content
    reserved   a save is planned or in flight; invisible to lookups until publish (or discard)
    published  findable under its key (the chain hash of the tokens before its position); unpinned
               ones sit in an LRU and count as free: reserve() evicts the oldest when none is free
    pinned     published and being restored from (never evicted; pins nest)
"""
from __future__ import annotations

from collections import OrderedDict

# Default pool size, proposed for phase 2's `--num-state-snapshots` (a count; the memory plan line shows
# bytes): 4 per sequence (a running request pins at most the one it restored from and holds one pending
# and one rolling save; the rest is the warm set of finished conversations), at most half of the spare
# memory: what the budget leaves after the slots and the KV blocks the running set can use (engine.py's
# `useful`); with caching on, the rest of the spare memory is best given to more KV blocks (a cache).
# 4B and 9B: 49.1 MiB each, so 128 for 32 sequences is 6.1 GiB (beside the 4B's default 8 GiB of KV,
# 32 x 8192 tokens, on an H200 with ~110 GiB spare); 27B: 146.8 MiB each, 18.4 GiB.
SNAPSHOTS_PER_SEQ = 4


def default_num_snapshots(max_num_seqs: int, snapshot_bytes: int, spare_bytes: int) -> int:
    """The pool size when the flag is not given (see above)."""
    return max(0, min(SNAPSHOTS_PER_SEQ * max_num_seqs, spare_bytes // 2 // max(snapshot_bytes, 1)))


class SnapshotPool:
    def __init__(self, first_id: int, count: int):
        if first_id < 1 or count < 0:
            raise ValueError(f"snapshot ids start after the slots (first_id >= 1) and count >= 0, got "
                             f"{first_id}, {count}")
        self.first_id, self.count = first_id, count
        self._free = list(range(first_id + count - 1, first_id - 1, -1))
        self._key: dict[int, bytes] = {}      # published id -> key
        self._by_key: dict[bytes, int] = {}
        self._pins: dict[int, int] = {}       # pinned id -> pin count
        self._reserved: set[int] = set()
        self._lru: OrderedDict[int, None] = OrderedDict()  # published, unpinned; oldest first

    @property
    def capacity(self) -> int:
        return self.count

    @property
    def ids(self) -> range:
        return range(self.first_id, self.first_id + self.count)

    @property
    def num_free(self) -> int:
        """Ids a save can get: free plus published-unpinned (evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Reserved or pinned: what running requests hold."""
        return self.count - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._key)

    def lookup(self, key: bytes) -> int | None:
        """The published snapshot under key, or None. No side effects."""
        return self._by_key.get(key)

    def pin(self, sid: int) -> None:
        assert sid in self._key, f"snapshot {sid} is not published"
        self._lru.pop(sid, None)
        self._pins[sid] = self._pins.get(sid, 0) + 1

    def unpin(self, sid: int) -> None:
        n = self._pins.pop(sid) - 1
        if n:
            self._pins[sid] = n
        else:
            self._lru[sid] = None  # most recently used

    def reserve(self) -> int | None:
        """An id for a save: a free one, else the least recently used unpinned snapshot (evicted).
        None when every id is reserved or pinned: the save is skipped."""
        if self._free:
            sid = self._free.pop()
        elif self._lru:
            sid, _ = self._lru.popitem(last=False)
            del self._by_key[self._key.pop(sid)]
        else:
            return None
        self._reserved.add(sid)
        return sid

    def publish(self, sid: int, key: bytes) -> bool:
        """The save into sid completed: findable under key from now on. False when key is already
        published (the same state, saved twice): sid goes back to the free list."""
        self._reserved.remove(sid)
        if key in self._by_key:
            self._free.append(sid)
            return False
        self._key[sid], self._by_key[key] = key, sid
        self._lru[sid] = None
        return True

    def discard(self, sid: int) -> None:
        """A reserved save that will never complete (its request ended, its step failed)."""
        self._reserved.remove(sid)
        self._free.append(sid)

    def demote(self, sid: int, key: bytes) -> None:
        """Evicted first from now on (a superseded rolling snapshot); no-op if pinned, or if sid no longer
        holds key (evicted and reused meanwhile)."""
        if sid in self._lru and self._key.get(sid) == key:
            self._lru.move_to_end(sid, last=False)
