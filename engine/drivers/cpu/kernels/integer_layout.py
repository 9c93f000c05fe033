"""How the integer kernels hold a matrix's codes, scales and activations: laid out once, when
the driver prepares (as ggml repacks a tensor for its CPU kernels), in the kernel's own order.

For 4-bit codes, a run of GROUP blocks (512 codes) puts block x's words on lane x, so the run's
eight chunks of 64 codes sum exactly into one int32 vector, converted and scaled once (by the
16 blocks' scales, one a lane) where blocks taken in pairs needed that for every 64 codes:
1.3-1.6x the speed on 2-16 tokens (`kernel_order`). 4-bit codes two a byte (`pack_nibbles`);
scales as float16 where that holds them exactly (`half_scales`), or spread over the lanes that
hold their blocks (`lane_scales`). Plain NumPy: nothing here is compiled.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
GROUP = 16  # 4-bit blocks whose exact sums share one int32 vector (one conversion, one scale)


def half_scales(d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """d and m as float16 bits (uint16), when float16 holds every one exactly (a GGUF's own
    block scales are float16): a 4-bit block is then 20 bytes instead of 24. None otherwise."""
    with np.errstate(over="ignore"):
        d16, m16 = d.astype(np.float16), m.astype(np.float16)
    if not (np.array_equal(d16.astype(np.float32), d) and np.array_equal(m16.astype(np.float32), m)):
        return None
    return np.ascontiguousarray(d16.view(np.uint16)), np.ascontiguousarray(m16.view(np.uint16))


def lane_width(blocks: int) -> int:
    """Scales a row (or token) holds in lane layout: 16 a run (see kernel_order)."""
    return 16 * (blocks // GROUP + blocks % GROUP // 2)


def lane_scales(s: np.ndarray, lone: bool = False) -> np.ndarray:
    """Per-block scales (rows, blocks) in lane layout: each run's 16 lanes as the kernel's
    accumulators hold its blocks, a block's scale on each of its lanes (`lone`: on its first
    lane only, the others 0). A run of 2 blocks is a run of 16 lanes all the same: laid out
    once here, its scales load as one vector, where spreading them in registers made SmolLM2's
    576-wide products 2-5% slower at 32 tokens (interleaved in one process, either first).
    Where every run is a full GROUP (a width a multiple of 512), each block has one lane and
    the layout is the block scales themselves: `s` is returned, not copied (at a 1B shape
    a second copy of every scale was 0.15 GB)."""
    rows, blocks = s.shape
    if blocks % GROUP == 0:
        return s
    out = np.zeros((rows, lane_width(blocks)), s.dtype)
    first = 0
    for run in range(out.shape[1] // 16):
        size = GROUP if run < blocks // GROUP else 2
        lanes = 16 // size
        spread = out[:, 16 * run : 16 * run + 16].reshape(rows, size, lanes)
        if lone:
            spread[:, :, 0] = s[:, first : first + size]
        else:
            spread[...] = s[:, first : first + size, None]
        first += size
    return out


def pack_nibbles(u: np.ndarray) -> np.ndarray:
    """Codes of 0..15 (o, i), two a byte (o, i / 2): in each chunk of 64 codes, byte j holds
    code j in its low nibble and code 32 + j in its high one."""
    o, i = u.shape
    pairs = u.reshape(o, i // 64, 2, 32)
    return np.ascontiguousarray(pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(o, i // 2)


def kernel_order(width: int) -> np.ndarray:
    """Where the kernel keeps each of a row's `width` features (codes and activations alike).
    Chunks of 64 are two vectors of 32 words; vpdpwssd sums two words into each of 16 int32
    lanes. A run of G blocks (GROUP; the blocks left after the last group go in runs of 2)
    gives each block 16 / G lanes, so after the run's G / 2 chunks lane x holds the exact sum
    of block x * G / 16 alone (at most 32 x 255 x LEVELS: no overflow), and one conversion and
    one scale serve the run."""
    blocks = width // BLOCK
    order = np.empty(width, np.int64)
    first = 0
    for size, runs in ((GROUP, blocks // GROUP), (2, blocks % GROUP // 2)):
        lanes = 16 // size  # a block's lanes
        for _ in range(runs):
            e = np.arange(size * BLOCK)
            block, q = e // BLOCK, e % BLOCK
            chunk, lane = q // (2 * lanes), block * lanes + q % (2 * lanes) // 2
            order[first + e] = first + chunk * 32 + lane * 2 + q % 2
            first += size * BLOCK
    return order


def arrange_codes(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A matrix's unsigned codes (o, i) as the integer kernel reads them (codes of 0..15 two a
    byte, others a byte each) and the order its activations take (kernel_order)."""
    arranged = in_kernel_order(u)
    return (pack_nibbles(arranged) if u.max(initial=0) <= 15 else arranged), kernel_order(u.shape[1])


def in_kernel_order(u: np.ndarray) -> np.ndarray:
    """u (o, i) with its columns where kernel_order puts them (`out[:, order] = u`), moved as
    transposes: a run of GROUP blocks swaps its (block, word pair) axes, a run of 2 its (block,
    half) axes. A scatter by the order took 7 of a Llama 3.2 1B shape's 26 s of preparing."""
    u = np.ascontiguousarray(u)
    o, i = u.shape
    full = i // (GROUP * BLOCK) * (GROUP * BLOCK)
    # Moved as wide words (a word pair as one uint16, a half-block as two uint64): numpy copies
    # a transpose item by item, and bytes one at a time cost 6x as much.
    pairs = u.view(np.uint16)[:, : full // 2].reshape(o, -1, GROUP, BLOCK // 2)
    runs = [pairs.transpose(0, 1, 3, 2).reshape(o, full // 2).view(np.uint8)]
    if full < i:
        halves = u[:, full:].view(np.uint64).reshape(o, -1, 2, 2, 2)
        runs.append(halves.transpose(0, 1, 3, 2, 4).reshape(o, (i - full) // 8).view(np.uint8))
    return np.ascontiguousarray(runs[0] if len(runs) == 1 else np.concatenate(runs, axis=1))
