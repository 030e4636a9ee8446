"""Prefix caching: hashed KV blocks, the GDN snapshot pool, prefix matching and its scheduling."""
import random

import pytest

from engine.kv_blocks import KVBlockManager, chain_hashes
from engine.state_snapshots import SnapshotPool, default_num_snapshots

BS = 16


def toks(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]



# ---- the pieces ----------------------------------------------------------------------------------
def test_chain_hashes_name_the_whole_prefix():
    a = toks(100, 0)
    h = chain_hashes(a, BS)
    assert len(h) == 6 and all(len(x) == 16 for x in h)          # the partial last block is never hashed
    assert chain_hashes(a[:64], BS) == h[:4]                      # a prefix's hashes are a prefix
    b = a.copy()
    b[3] += 1
    hb = chain_hashes(b, BS)
    assert all(x != y for x, y in zip(h, hb))                     # one token changes every later block
    c = a[16:32] + a[16:32]
    assert chain_hashes(c, BS)[0] != chain_hashes(c, BS)[1]       # same tokens, other position: other hash
    # the same in every process (not Python's randomized hash)
    assert chain_hashes(list(range(16)), BS)[0].hex() == chain_hashes(list(range(16)), BS)[0].hex()


def test_no_cache_path_hands_out_blocks_as_before():
    """Without published blocks the manager is the old free list: same ids, same order."""
    class Old:
        def __init__(self, n):
            self.free = list(range(n - 1, 0, -1))

        def allocate(self, k):
            return [self.free.pop() for _ in range(k)]

        def release(self, blocks):
            self.free.extend(reversed(blocks))

    new, old = KVBlockManager(40, BS), Old(40)
    rng, held = random.Random(1), []
    for _ in range(200):
        if held and rng.random() < 0.45:
            x = held.pop(rng.randrange(len(held)))
            new.free(x)
            old.release(x)
        else:
            k = rng.randrange(1, 6)
            if k <= new.num_free:
                x = new.allocate(k)
                assert x == old.allocate(k)
                held.append(x)
        assert new.num_free == len(old.free) and new.num_used == new.capacity - new.num_free


def test_kv_blocks_share_keep_cached_and_evict_lru():
    kv = KVBlockManager(9, BS)  # 8 usable
    a = kv.allocate(4)
    hs = chain_hashes(toks(64, 0), BS)
    for b, h in zip(a, hs):
        assert kv.publish(b, h)
    assert kv.lookup(hs) == a and kv.lookup(hs[:2]) == a[:2] and kv.lookup([b"x"] + hs) == []
    x = kv.allocate(1)
    assert not kv.publish(x[0], hs[0])                # the hash is taken: x stays private
    kv.free(x)
    kv.free(a)                                        # refcount 0: still findable, counted free
    assert kv.num_free == 8 and kv.num_used == 0 and kv.num_cached == 4 and kv.lookup(hs) == a
    assert kv.num_idle(a[:3]) == 3
    kv.share(a[:2])                                   # revived: no longer free
    assert kv.num_free == 6 and kv.num_idle(a[:3]) == 1 and kv.ref_count(a[0]) == 1
    got = kv.allocate(5)                              # 4 plain free, then the oldest cached: the chain's tail
    assert a[3] in got and a[2] not in got and kv.lookup(hs) == a[:3]
    kv.free(got)
    kv.free(a[:2])
    assert kv.num_free == 8 and kv.num_cached == 3
    with pytest.raises(RuntimeError, match="exhausted"):
        kv.allocate(9)
    with pytest.raises(AssertionError, match="twice"):
        kv.free(a[:1])


def test_snapshot_pool_ids_pins_lru():
    p = SnapshotPool(first_id=5, count=3)
    assert list(p.ids) == [5, 6, 7] and p.num_free == 3
    ids = [p.reserve() for _ in range(3)]
    assert sorted(ids) == [5, 6, 7] and p.reserve() is None and p.num_used == 3
    assert p.lookup(b"a") is None                     # reserved: invisible
    for sid, k in zip(ids, (b"a", b"b", b"c")):
        assert p.publish(sid, k)
    assert p.num_free == 3 and p.num_used == 0 and p.lookup(b"b") == ids[1]
    p.pin(ids[0])                                     # a: pinned, never evicted
    p.pin(ids[0])
    p.unpin(ids[0])
    r = p.reserve()                                   # evicts the LRU unpinned: b
    assert r == ids[1] and p.lookup(b"b") is None and p.lookup(b"a") == ids[0]
    assert not p.publish(r, b"c")                     # c is already there: r is freed
    p.demote(ids[2], b"c")
    assert p.reserve() == ids[1] and p.reserve() == ids[2] and p.reserve() is None  # free first, then demoted c
    p.discard(ids[1])
    p.discard(ids[2])
    p.unpin(ids[0])
    assert p.num_free == 3 and p.num_used == 0 and p.num_cached == 1
    with pytest.raises(ValueError):
        SnapshotPool(0, 4)                            # id 0 is the dummy slot


def test_default_pool_size():
    mib = 1 << 20
    assert default_num_snapshots(32, 49 * mib, 100 << 30) == 128
    assert default_num_snapshots(32, 147 * mib, 10 << 30) == 34      # half of what is left
    assert default_num_snapshots(32, 49 * mib, 0) == 0
