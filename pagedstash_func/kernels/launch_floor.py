"""Launch floor: a bare copy beside a one-program launch, what two launches cost a copy.

Not part of the stash. The stash is a one-program reservation, then a page writer that waits
for it; the pop is a page reader, then a one-program release that waits for it (`stash_copy`,
`stash_pop`). This file times the same shapes with the bookkeeping taken out: a flat copy of
contiguous bytes in the same tiles and grid, no page table, and a one-program launch that
moves one word. `bench stash --floor` prints them beside the stash and the pop, so that the distance
from each kernel to what two launches allow on the device is measured, not guessed: a
reservation-then-data design should not beat ``"word first"``, nor a data-then-release design
``"word after"``, by more than the spread of the timings.

Where programmatic dependent launch is available (`use_pdl`) the second launch of each pair
is a programmatic dependent, as in the stash and the pop: the copy that follows a word loads
its tile and waits before it stores (the stash's writer cannot store before its table is
written), and the word that follows a copy waits before its store (the release empties the
table only after the reader has read it).

Order as in the Triton tutorials: the pure-torch twin, the kernels, the launcher.
"""

from __future__ import annotations

import torch

from ._triton import gdc_launch_dependents, gdc_wait, triton, tl
from ._launch import use_pdl

FLOOR_SHAPES = ("alone", "word first", "word after")


# ----------------------------------------------------------------------------- torch twin


def floor_copy_reference(src: torch.Tensor, out: torch.Tensor, word: torch.Tensor,
                         shape: str) -> None:
    """Pure-torch twin of `floor_copy_triton`: ``out`` gets ``src``'s elements, and but for
    ``"alone"`` ``word[1]`` gets ``word[0]``."""
    check_floor_args(src, out, word, shape)
    out.copy_(src)
    if shape != "alone":
        word[1] = word[0]


# ----------------------------------------------------------------------------- Triton kernels


@triton.jit
def _flat_copy_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr, WAIT: tl.constexpr,
                      TRIGGER: tl.constexpr):
    # The page writer's and reader's data path without their page table: the same grid of
    # programs looping over tiles, nothing to look up. WAIT stands for the writer's wait for
    # its table: like the writer, a program loads its first tile, then waits, then stores.
    if TRIGGER:
        gdc_launch_dependents()
    pid = tl.program_id(0).to(tl.int64)       # int64 tiles: offsets past 2^31 elements
    nprog = tl.num_programs(0).to(tl.int64)
    copy_tile(src_ptr, out_ptr, pid * BLOCK, n, BLOCK, WAIT)
    for t in range(pid + nprog, tl.cdiv(n, BLOCK), nprog):
        copy_tile(src_ptr, out_ptr, t * BLOCK, n, BLOCK, False)


@triton.jit
def copy_tile(src_ptr, out_ptr, start, n, BLOCK: tl.constexpr, WAIT: tl.constexpr):
    """Copy elements ``[start, start + BLOCK)`` below ``n``, waiting (WAIT) between the load
    and the store."""
    lanes = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:        # full tile: unmasked, so the accesses vectorise
        tile = tl.load(src_ptr + lanes)
        if WAIT:
            gdc_wait()
        tl.store(out_ptr + lanes, tile)
    else:
        tile = tl.load(src_ptr + lanes, mask=lanes < n)
        if WAIT:
            gdc_wait()
        tl.store(out_ptr + lanes, tile, mask=lanes < n)


@triton.jit
def _word_kernel(word_ptr, WAIT: tl.constexpr, TRIGGER: tl.constexpr):
    # The least a reservation or a release does: one dependent load and one store.
    if TRIGGER:
        gdc_launch_dependents()
    value = tl.load(word_ptr)
    if WAIT:
        gdc_wait()
    tl.store(word_ptr + 1, value)


# ----------------------------------------------------------------------------- launcher


def floor_copy_triton(src: torch.Tensor, out: torch.Tensor, word: torch.Tensor, shape: str,
                      block: int, warps: int, programs: int = 0) -> None:
    """Copy ``src`` into ``out`` in tiles of ``block`` elements with ``warps`` warps and
    ``programs`` programs (0: one per tile; fewer loop over tiles, as the kernels' grid
    does): alone, after a one-program launch on ``word`` (the stash's shape) or before one
    (the pop's)."""
    check_floor_args(src, out, word, shape)
    for name, value, least in (("block", block, 16), ("warps", warps, 1)):
        if type(value) is not int or value < least or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= {least}, got {value!r}")
    if type(programs) is not int or programs < 0:
        raise ValueError(f"programs must be an int >= 0 (0: one per tile), got {programs!r}")
    pdl = use_pdl(src.device)
    n = src.numel()
    grid = (max(1, programs or triton.cdiv(n, block)),)
    if shape == "word first":
        _word_kernel[(1,)](word, WAIT=False, TRIGGER=pdl, num_warps=1)
        _flat_copy_kernel[grid](src, out, n, BLOCK=block, WAIT=pdl, TRIGGER=False,
                                num_warps=warps, launch_pdl=pdl)
    elif shape == "word after":
        _flat_copy_kernel[grid](src, out, n, BLOCK=block, WAIT=False, TRIGGER=pdl,
                                num_warps=warps)
        _word_kernel[(1,)](word, WAIT=pdl, TRIGGER=False, num_warps=1, launch_pdl=pdl)
    else:
        _flat_copy_kernel[grid](src, out, n, BLOCK=block, WAIT=False, TRIGGER=False,
                                num_warps=warps)


def check_floor_args(src, out, word, shape) -> None:
    """`ValueError` for arguments the floor copy cannot take."""
    if shape not in FLOOR_SHAPES:
        raise ValueError(f"shape must be one of {FLOOR_SHAPES}, got {shape!r}")
    if src.shape != out.shape or src.dtype != out.dtype or src.device != out.device:
        raise ValueError(f"out must match src (got {tuple(out.shape)} {out.dtype} on "
                         f"{out.device} for {tuple(src.shape)} {src.dtype} on {src.device})")
    if not (src.is_contiguous() and out.is_contiguous()):
        raise ValueError("src and out must be contiguous: call .contiguous() first")
    if (word.dtype != torch.int32 or word.numel() < 2 or word.device != src.device
            or not word.is_contiguous()):
        raise ValueError(f"word must be a contiguous int32 tensor of at least 2 elements on "
                         f"{src.device}, got {word.dtype} of {word.numel()} on {word.device}"
                         f"{'' if word.is_contiguous() else ' (not contiguous)'}")
