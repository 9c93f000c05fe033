"""Picking on the host for a driver whose device picks nothing: the marked rows' tokens drawn
from the step's full logits with the engine's own sampler, so a marked row's token is the
same function of its logits, parameters and stream on every backend."""

from __future__ import annotations

import numpy as np

from .. import sampler
from ..step import PICK_HOST, RowWork, StepArrays, StepOutput, host_logits, marked_rows


def pick_from_logits(logits: np.ndarray, step: StepArrays, batch: list[RowWork]) -> StepOutput:
    """The marked rows picked from a step's full logits with the engine's sampler, the
    others' logits kept: what a driver whose device cannot pick returns."""
    mode = step.picks[:, 0]
    if not mode.any():
        return host_logits(batch, logits)
    picked = marked_rows(batch, mode != PICK_HOST)
    ids = np.full(len(mode), -1, np.int32)
    i = 0
    for w, row_picked in zip(batch, picked, strict=True):
        if row_picked:
            for j in range(w.num_logits):
                ids[i + j] = sampler.sample(logits[i + j], w.pick.params, w.pick.uniform(j))
        i += w.num_logits
    return StepOutput(picked, logits[ids < 0], ids)
