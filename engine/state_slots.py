"""Pools of GDN state: one conv + recurrent slot per running sequence, and (speculative decoding) one log
set per speculating sequence.

Slot 0 is a dummy (CUDA-graph padding). The pools only hand out ids; the model runner zeroes
a slot's state on the first chunk a sequence runs in it, so a reused slot never leaks state.

A log set (Cache.conv_log / rec_log) holds what each of a verify's 1 + k tokens changed in the GDN state; the
slot keeps the state before them, and the sequence's next step replays the tokens the verify committed
(step.py). A request admitted when no set is free runs without speculation.
"""
from __future__ import annotations

DUMMY_SLOT = 0


class StateSlotPool:
    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (one is the dummy slot), got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, DUMMY_SLOT, -1))

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("state slot pool exhausted")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)


class SpecLogPool:
    def __init__(self, num_sets: int):
        """Sets 0 .. num_sets - 1; the cache has one more (num_sets), for CUDA graphs' padded verify rows."""
        self.capacity = num_sets
        self._free = list(range(num_sets - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A free set, or None (the request then runs without speculation)."""
        return self._free.pop() if self._free else None

    def free(self, log: int) -> None:
        self._free.append(log)
