"""What the CPU driver takes from the machine beyond NumPy and numba: Intel oneMKL's packed
products (mkl.py), 2 MiB pages (huge_pages.py), and the host's memory and CPU name (host.py)."""
