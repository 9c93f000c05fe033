"""A family's prepared weights as a mapping whose entries are made on their first read and
kept (`PreparedWeights`).

Preparing reorders, folds and widens every matrix to float32 (on SmolLM2, 540 MB written
from the file's cached weights: 4-5 s of a 7 s start). A driver whose products run on the
file's own block codes never reads most of those copies, so it should not wait for them or
hold them; a driver that reads every weight (to upload it, or to run the NumPy path) makes
each as it comes to it, the same arrays as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping

import numpy as np


class PreparedWeights(Mapping[str, np.ndarray]):
    def __init__(self, makers: dict[str, Callable[[], np.ndarray]]):
        self._makers = dict(makers)
        self._made: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> np.ndarray:
        made = self._made.get(name)
        if made is not None:
            return made
        make = self._makers[name]  # KeyError for a weight the family does not prepare
        with self._lock:
            if name not in self._made:
                self._made[name] = make()
            return self._made[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def made(self) -> list[str]:
        """The weights read so far."""
        return list(self._made)
