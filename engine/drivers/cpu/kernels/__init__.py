"""The CPU driver's numba kernels, a file a family of kernels, apart from the policy of when
each runs and on how many threads (the modules above this folder).

    numeric.py          float flags, error model, exp and the float bits every kernel shares
    glue.py             the glue between products: norm, SiLU times up, rotary with the K/V write
    few_token.py        float32 W @ X for a few tokens
    attention.py        paged attention in place (attention_ir, _tile, _query: its LLVM IR)
    quantize.py         the activations quantized to 16 bits a block, for every product on codes
    integer.py          integer products on block codes (integer_tile.py: its LLVM IR, on
                        integer_dot.py's dot product: AVX-512 VNNI or AVX2)
    integer_layout.py   how the integer kernels hold codes and scales (plain NumPy, laid out once)
    blocks.py           products on block codes widened to float32 a block at a time
    decoder.py          a Llama decoder stack in one call, from the kernels above
    sizes.py            the sizes the kernels compile in that the policy reads too (no numba)

Every kernel releases the GIL (nogil): the server's event loop, which streams tokens and
answers /health, runs in the same process and would otherwise stop for each kernel's run.
numba caches a kernel on disk only when everything it calls is a module-level global (kernels
that called helpers as closure variables were rebuilt in every process, 12 s per start).
Importing a module here compiles nothing; the runtime (../runtime.py) chooses numba's target
and threading layer, stamps the kernels' caches and builds them.
"""
