"""Slot pool for the GDN conv and recurrent state: one slot per running sequence.

Slot 0 is a dummy (CUDA-graph padding). The pool only hands out ids; the model runner zeroes
a slot's state on the first chunk a sequence runs in it, so a reused slot never leaks state.
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
