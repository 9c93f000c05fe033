"""The machine a load run ran on, as a results page names it: the CPU's model, how many CPUs,
and the vector instruction sets a CPU-bound server's speed depends on."""

from __future__ import annotations

import os
from pathlib import Path

# The flags /proc/cpuinfo spells these instruction sets with, in the order a page lists them.
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16",
                "amx_tile", "amx_int8", "amx_bf16")


def cpu(cpuinfo: str | None = None) -> dict:
    """{"model", "cpus", "flags"}: what Linux says of the CPU; model None and no flags elsewhere."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    present = set(fields.get("flags", "").split())
    return {"model": fields.get("model name"), "cpus": os.cpu_count(),
            "flags": [f for f in VECTOR_FLAGS if f in present]}
