"""The product choices (choice.py) measured on this machine, kept so that a start reads them
instead of timing every path again: timing takes seconds to tens of seconds, and the answer
stays the same until something it depends on changes.

    <cache root>/choices/<key digest>.json      (engine/cache_dir.py: ~/.cache/poot by default)

The key (`choice_key`) is everything that can change the answer: the CPU (its name and cores,
its flags, the features numba compiles for, which name any instruction set forced on it),
the threads the products run on, the libraries' versions (numpy, numba, llvmlite, mkl) and
the settings that pick their code (OPENBLAS_CORETYPE, MKL_ENABLE_INSTRUCTIONS, MKL_CBWR), the
products (each shape's matrices, code types and candidate paths), the plan's rows and token
budget, and the project's version. A file is used only when the key it holds is the one asked
for; one that cannot be read or parsed is ignored with one log line and replaced by the next
measurement, never a failed start. `poot-serve --retune` measures afresh whatever is kept.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ....cache_dir import cache_root
from ..platform.host import cpu_name

log = logging.getLogger("poot.engine")

# Bumped whenever choice.py would decide differently from the same timings, or the paths it
# times run differently, so that what an older rule chose is measured again (2: MKL held to
# the instruction sets of POOT_CPU_ISA's mode).
CHOICE_FORMAT = 2
LIBRARIES = ("numpy", "numba", "llvmlite", "mkl")
THREAD_SETTINGS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# The libraries' own choice of code: which CPU OpenBLAS takes this one for, what MKL may dispatch to.
LIBRARY_SETTINGS = ("OPENBLAS_CORETYPE", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


@dataclass(frozen=True, slots=True)
class Stored:
    """A measured choice as kept: each shape's ShapeChoice.as_data(), when it was measured
    (UTC, ISO 8601) and how long measuring took."""

    choices: list
    measured_at: str
    seconds: float


class ChoiceCache:
    """The kept choices, one JSON file per key, in `folder` (default: the engine's cache)."""

    def __init__(self, folder: str | os.PathLike | None = None):
        self._folder = Path(folder) if folder is not None else None

    @property
    def folder(self) -> Path:
        return self._folder if self._folder is not None else cache_root() / "choices"

    def path(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return self.folder / f"{digest}.json"

    def read(self, key: dict) -> Stored | None:
        """The choice kept for `key`, or None: none kept, or one that cannot be used (logged)."""
        path = self.path(key)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            log.warning("ignoring the kept product choice %s: %s", path, e)
            return None
        try:
            data = json.loads(text)
            if data["key"] != json.loads(json.dumps(key)):
                return None  # another key's file under this digest: measure, and replace it
            stored = Stored(list(data["choices"]), str(data["measured_at"]), float(data["seconds"]))
            if not all(isinstance(c, dict) for c in stored.choices):
                raise ValueError("choices are not objects")
            return stored
        except (ValueError, KeyError, TypeError) as e:
            log.warning("ignoring the kept product choice %s: it cannot be read (%s)", path, " ".join(str(e).split()))
            return None

    def write(self, key: dict, stored: Stored) -> None:
        """Keeps `stored` for `key` (whole or not at all); a cache that cannot be written only
        costs the next start its measuring (logged)."""
        path = self.path(key)
        body = json.dumps({"key": key, "measured_at": stored.measured_at, "seconds": round(stored.seconds, 3),
                           "choices": stored.choices}, indent=1, sort_keys=True)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(body)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as e:
            log.warning("cannot keep the product choice under %s: %s", path.parent, e)


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def choice_key(shapes: list[dict], rows: int, token_budget: int, max_step_tokens: int, runtime) -> dict:
    """Everything the choice for these products depends on (see the module's docstring).
    `shapes`: per shape, {"shape", "head", "matrices", "codes" (dtypes), "paths" (candidates)}."""
    numba = runtime.numba
    return {
        "format": CHOICE_FORMAT,
        "poot": _version("poot"),
        "cpu": cpu_name(),
        "flags": _cpu_flags(),
        "target": [numba.config.CPU_NAME or "host", sorted(runtime.features())],
        "threads": [numba.config.NUMBA_NUM_THREADS, *(os.environ.get(k) for k in THREAD_SETTINGS[1:])],
        "libraries": {name: _version(name) for name in LIBRARIES},
        "library_settings": [os.environ.get(k) for k in LIBRARY_SETTINGS],
        "products": sorted(shapes, key=lambda s: (s["shape"], s["head"])),
        "plan": {"rows": rows, "token_budget": token_budget, "max_step_tokens": max_step_tokens},
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_flags() -> str:
    """The CPU's flags as the kernel lists them (/proc/cpuinfo), sorted; the machine's name
    where there is no such list."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86, Arm
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    import platform

    return platform.machine()
