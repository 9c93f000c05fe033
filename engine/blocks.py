"""The KV block pool: which physical blocks are free, and who holds each one."""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(n)]
        for i in ids:
            self.ref_counts[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if self.ref_counts[i] <= 0:
                raise RuntimeError(f"block {i} freed while not held")
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                self.free_ids.append(i)
