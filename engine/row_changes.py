"""The rows taken and left since the driver last heard: what the next step plan carries.

A row is opened in phase 3 and closed wherever its request ends (a hang-up in phase 2, a
stop rule in phase 5, a refused step); the driver learns both only from the next plan.
A row opened and closed again before any plan carried it is never told at all.
"""

from __future__ import annotations

from .step import RowOpen


class RowChanges:
    def __init__(self) -> None:
        self._opens: dict[int, RowOpen] = {}
        self._closes: list[int] = []

    def open(self, row: int, block_table: list[int]) -> None:
        self._opens[row] = RowOpen(row, tuple(block_table))

    def close(self, row: int) -> None:
        if self._opens.pop(row, None) is None:  # a row the driver never heard of stays untold
            self._closes.append(row)

    def pending(self) -> tuple[tuple[RowOpen, ...], tuple[int, ...]]:
        """(opens, closes) for the next plan; they stay pending until `delivered()`."""
        return tuple(self._opens.values()), tuple(self._closes)

    def delivered(self) -> None:
        """A plan that carried them was applied by the driver."""
        self._opens.clear()
        self._closes.clear()

    def __bool__(self) -> bool:
        return bool(self._opens or self._closes)
