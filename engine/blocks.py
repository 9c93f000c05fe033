"""The KV block pool: which physical blocks are free, and who holds each one.

A block is in exactly one of three places:
- free: holds nothing anyone may look up;
- held: mapped by at least one running sequence (`ref_counts[i]` of them);
- cached: held by nobody but still holding a registered prefix. Cached blocks count as room:
  `allocate` takes free blocks first, then evicts cached ones, least recently used first.
A block becomes registered through `register` (the prefix cache does it) and goes back to
plain when it is evicted; without a prefix cache nothing is registered and no block is ever
cached.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.cached_ids: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.registered = [False] * num_blocks
        self.on_evict: Callable[[int], None] | None = None  # told before a cached block is reused

    @property
    def num_free(self) -> int:
        """Room for new blocks: free ones and evictable cached ones."""
        return len(self.free_ids) + len(self.cached_ids)

    @property
    def num_cached(self) -> int:
        return len(self.cached_ids)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks with {self.num_free} free")
        ids = []
        for _ in range(n):
            if self.free_ids:
                i = self.free_ids.popleft()
            else:
                i, _ = self.cached_ids.popitem(last=False)
                self._evict(i)
            self.ref_counts[i] = 1
            ids.append(i)
        return ids

    def hold(self, i: int) -> None:
        """One more holder of a registered block (a prefix hit); a cached one leaves the LRU."""
        if not self.registered[i]:
            raise RuntimeError(f"block {i} is not registered")
        if self.ref_counts[i] == 0:
            del self.cached_ids[i]
        self.ref_counts[i] += 1

    def share(self, i: int) -> None:
        """One more holder of a held block (the choices of one request share their prompt)."""
        if self.ref_counts[i] <= 0:
            raise RuntimeError(f"block {i} shared while not held")
        self.ref_counts[i] += 1

    def register(self, i: int) -> None:
        if self.ref_counts[i] <= 0:
            raise RuntimeError(f"block {i} registered while not held")
        self.registered[i] = True

    def free(self, ids: Iterable[int]) -> None:
        """Drops one holder of each block, in the order given: a registered block whose last
        holder leaves becomes cached, as the most recently used."""
        for i in ids:
            if self.ref_counts[i] <= 0:
                raise RuntimeError(f"block {i} freed while not held")
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                if self.registered[i]:
                    self.cached_ids[i] = None
                else:
                    self.free_ids.append(i)

    def _evict(self, i: int) -> None:
        self.registered[i] = False
        if self.on_evict is not None:
            self.on_evict(i)
