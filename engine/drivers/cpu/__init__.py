"""The CPU driver (driver.py says how the package is laid out). Importing it loads neither
numba nor MKL: the runtime does, when a driver prepares."""

from .driver import CpuDriver

__all__ = ["CpuDriver"]
