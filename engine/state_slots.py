"""Pools of GDN conv + recurrent state rows: one slot per running sequence, and (speculative decoding) one
set of rollback rows per speculating sequence.

Slot 0 is a dummy (CUDA-graph padding). The pools only hand out ids; the model runner zeroes
a slot's state on the first chunk a sequence runs in it, so a reused slot never leaks state.

A rollback set is k consecutive rows (k = the drafts per verify): a verify writes the state after each of
its tokens but the last into them (step.py), and a verify that accepted a < k drafts copies row a back
into the slot. A request admitted when no set is free runs without speculation.
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


class SpecRowPool:
    def __init__(self, first_row: int, rows_per_set: int, num_sets: int):
        self.capacity = num_sets
        self._free = [first_row + i * rows_per_set for i in range(num_sets - 1, -1, -1)]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """The first row of a free set, or None (the request then runs without speculation)."""
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        self._free.append(row)
