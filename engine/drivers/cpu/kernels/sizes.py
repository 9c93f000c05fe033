"""Sizes the kernels compile in that the policy above this folder reads too: plain numbers,
importable without numba (numba freezes a global's value into the code that reads it, so they
live in this folder, whose files stamp every kernel's cache)."""

GLUE_PARALLEL_MIN = 1 << 15  # elements below which a glue kernel (norm, rotary, SiLU, softmax) runs serially
TOKEN_RUN = 64  # most tokens per run of a parallel glue kernel: inner loops long enough to vectorize
