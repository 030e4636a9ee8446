# Simulation of gdn_chunk_state_wg's producer/consumer protocol (HEAD of s30-wgp).
# 128 producer + 128 consumer threads, mbarriers full[2]/empty[2] with count 128, named barrier 1 (128).
# Random and biased interleavings; checks deadlock, reads of unlanded stages, overwrites of stages in use,
# and parity aliasing (a wait passing on a phase other than the intended one).
import random, sys

NP = NC = 128

class MBar:
    def __init__(s, n): s.n, s.pending, s.ph = n, n, 0
    def arrive(s):
        s.pending -= 1
        assert s.pending >= 0
        if s.pending == 0: s.ph += 1; s.pending = s.n
    def ready(s, parity): return (s.ph & 1) != parity

def run(n, seed, bias, empty_parity=lambda c: ((c >> 1) - 1) & 1, full_parity=lambda c: (c >> 1) & 1, arrive_early=False):
    rng = random.Random(seed)
    full, empty = [MBar(128), MBar(128)], [MBar(128), MBar(128)]
    # stage contents per producer thread portion: (chunk, complete?)
    stage = [[(None, False)] * NP for _ in range(2)]
    readers = [set(), set()]
    bar = {'gen': 0, 'cnt': 0}
    def prod(p):
        for c in range(n):
            s = c & 1
            if c >= 2:
                k = (c >> 1) - 1
                yield ('wait', empty[s], empty_parity(c), k)
            if readers[s]: raise AssertionError(f'n={n} producer {p} overwrites stage {s} (chunk {c}) while consumers {sorted(readers[s])[:3]} read it')
            stage[s][p] = (c, False); yield ('step',)
            stage[s][p] = (c, True)          # cp.async.wait_group 0 + fence
            full[s].arrive(); yield ('step',)
    def cons(t):
        yield ('bar',)                        # (store_lo) fence + bar.sync 1 at loop top comes after the wait, modelled below
        for c in range(n):
            s = c & 1
            yield ('wait', full[s], full_parity(c), c >> 1)
            yield ('bar',)
            for p in range(NP):
                if stage[s][p] != (c, True): raise AssertionError(f'n={n} consumer {t} reads stage {s} for chunk {c}: portion {p} holds {stage[s][p]}')
            readers[s].add(t); yield ('step',)  # wgmma / ld.shared of W,q,P,U,aux,k
            for p in range(NP): assert stage[s][p] == (c, True)
            if arrive_early: empty[s].arrive(); yield ('step',); readers[s].discard(t); yield ('step',)
            else: readers[s].discard(t); empty[s].arrive(); yield ('step',)
            yield ('bar',)                    # o tile
    threads = [prod(p) for p in range(NP)] + [cons(t) for t in range(NC)]
    blocked = [None] * len(threads)  # pending op
    done = [False] * len(threads)
    # prime
    for i, g in enumerate(threads):
        try: blocked[i] = next(g)
        except StopIteration: done[i] = True
    inbar = set()
    steps = 0
    while not all(done):
        runnable = []
        for i in range(len(threads)):
            if done[i] or i in inbar: continue
            op = blocked[i]
            if op[0] == 'wait':
                _, mb, par, k = op
                if mb.ready(par):
                    runnable.append(i)
            else: runnable.append(i)
        if not runnable:
            raise AssertionError(f'n={n} deadlock: {sum(done)} done, in bar {len(inbar)}')
        if bias == 'prod': pool = [i for i in runnable if i < NP] or runnable
        elif bias == 'cons': pool = [i for i in runnable if i >= NP] or runnable
        else: pool = runnable
        i = rng.choice(pool)
        op = blocked[i]
        if op[0] == 'wait':
            _, mb, par, k = op
            assert mb.ph == k + 1, f'n={n} parity alias: phase {mb.ph} for intended {k}'
        if op[0] == 'bar':
            inbar.add(i)
            if len(inbar) == NC:
                rel = list(inbar); inbar.clear()
                for j in rel:
                    try: blocked[j] = next(threads[j])
                    except StopIteration: done[j] = True
            continue
        try: blocked[i] = next(threads[i])
        except StopIteration: done[i] = True
        steps += 1
    return steps

def check(label, **kw):
    bad = 0
    for n in (0, 1, 2, 3, 5, 16):
        for seed in range(12 if n < 16 else 6):
            for bias in ('none', 'prod', 'cons'):
                try: run(n, seed, bias, **kw)
                except AssertionError as e:
                    bad += 1
                    if bad <= 2: print(f'  [{label}] {e}')
    print(f'{label}: {"PASS" if not bad else f"{bad} failing runs"}')

check('as written (HEAD)')
check('mutant: empty parity (c>>1)&1', empty_parity=lambda c: (c >> 1) & 1)
check('mutant: full parity ((c>>1)+1)&1', full_parity=lambda c: ((c >> 1) + 1) & 1)
check('mutant: empty arrive before reads end', arrive_early=True)
