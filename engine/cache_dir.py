"""Where the engine keeps what it works out once per machine and reuses on every start: a
model's float32 weights and block codes (models/gguf_loader.py), the CPU driver's product
choices and numba's compiled kernels (drivers/cpu/).

    $POOT_CACHE_DIR, else $XDG_CACHE_HOME/poot, else ~/.cache/poot
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("POOT_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "poot"
