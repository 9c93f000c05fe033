"""The failure `--fault-injection` arms for a driver's next step: refused before it runs, or
a device fault after it ran. Only POST /debug/fault arms one; a step takes it, once."""

from __future__ import annotations

KINDS = ("refuse", "fault")


class ArmedFailure:
    def __init__(self) -> None:
        self.kind: str | None = None

    def arm(self, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown driver failure {kind!r}")
        self.kind = kind

    def take(self) -> str | None:
        """The armed failure, disarmed: what the step about to run must do."""
        kind, self.kind = self.kind, None
        return kind
