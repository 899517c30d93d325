"""Launch sizes for the stash kernels, chosen per device and row width.

Both kernels are pure copies, so the only question is how many bytes each program moves per
iteration and how many programs stay resident; the answer differs between them (see
`BY_CAPABILITY`). A tile is ``block`` contiguous elements inside
one page (a page of ``page_size`` rows of width ``W`` is contiguous in the pool and in the
capacity buffer alike), so the row width only matters when a whole page is smaller than the
default tile: then the tile shrinks to the page, to avoid lanes that are always masked off.
The grid is persistent when ``programs`` is smaller than the number of tiles (each program
loops over tiles); on the H200 one program per tile measured faster, counting the tiles of the
rows expected to be valid rather than of the capacity (`_pagestack.grid_size`).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch


class Launch(NamedTuple):
    block: int          # elements per tile (a power of two)
    programs: int       # most programs in the grid
    num_warps: int


ONE_PER_TILE = 1 << 31   # `programs` that never caps the grid: a program per tile

# Per compute capability and kernel ("stash": the page writer after the reserve; "pop": the
# page reader before the release): (bytes per tile, programs per SM or None for one program
# per tile, warps). Only measured entries belong here. SM 9.0, on the H200 (`bench stash`, and
# `bench stash --sweep`), both a program per tile of the expected rows:
# - neither kernel counts in a shared counter (their bookkeeping is a one-program launch of
#   its own), so both move small tiles, which stream at copy_'s speed: bare flat copies of 2
#   and 4 KiB tiles measured 99-101 % of copy_ where 32 KiB tiles measured 94-97 %;
# - the stash's writer: 2 KiB tiles and 4 warps (sweep at H 2048 and 7168, 8192 and 65536
#   rows: worst 93.7 %, mean 97.4 %; 4 KiB: 93.4 % and 97.1 %);
# - the pop's reader: 4 KiB tiles and 4 warps (sweep: worst 94.1 %, mean 97.2 %; 32 KiB and 8
#   warps: 94.3 % and 96.7 %; 2 KiB tiles: 87.6 % worst). The pop in one launch, which took
#   a ticket per program to find the last, needed 16 KiB tiles and reached 95 % at 65536 rows.
# Other devices get the anchor's default: 1024 bf16 elements per tile and about 2048 programs
# (16 per SM on a 132-SM part).
BY_CAPABILITY: dict[tuple[int, int], dict[str, tuple[int, int | None, int]]] = {
    (9, 0): {"stash": (2048, None, 4), "pop": (4096, None, 4)},
}
_DEFAULT = (2048, 16, 4)
_CPU = (1024, 8, 4)   # interpreter: fewer, larger programs keep tests fast
KERNELS = ("stash", "pop")


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def choose_launch(device: torch.device, width: int, element_size: int, page_size: int,
                  block: int = 0, programs: int = 0, warps: int = 0, *,
                  kernel: str) -> Launch:
    """Launch sizes for one ``kernel`` ("stash" or "pop") over rows of ``width`` elements of
    ``element_size`` bytes.

    ``block``, ``programs`` and ``warps`` override the choice when positive (benchmarks, the
    launch sweep and tests pass them explicitly).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if device.type == "cuda":
        tile_bytes, auto_programs, auto_warps = cuda_defaults(_index(device), kernel)
    else:
        tile_bytes, auto_programs, auto_warps = _CPU
    auto_block = max(16, tile_bytes // element_size)
    auto_block = min(auto_block, max(16, _next_pow2(page_size * width)))
    return Launch(block=_next_pow2(block) if block > 0 else auto_block,
                  programs=programs if programs > 0 else auto_programs,
                  num_warps=warps if warps > 0 else auto_warps)


@functools.lru_cache(maxsize=None)
def cuda_defaults(index: int, kernel: str) -> tuple[int, int, int]:
    """(bytes per tile, programs, warps) of ``kernel`` on CUDA device ``index``, from
    `BY_CAPABILITY`; cached."""
    props = torch.cuda.get_device_properties(index)
    entry = BY_CAPABILITY.get((props.major, props.minor), {})
    tile_bytes, per_sm, warps = entry.get(kernel, _DEFAULT)
    programs = per_sm * props.multi_processor_count if per_sm else ONE_PER_TILE
    return tile_bytes, programs, warps


PDL_OFF_ENV = "PAGEDSTASH_NO_PDL"


_OFF = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False,
        "": False}


def use_pdl(device: torch.device) -> bool:
    """Whether the stash's and the pop's second launch may start while their first runs
    (programmatic dependent launch): on NVIDIA GPUs of compute capability 9.0 and later,
    unless the environment sets ``PAGEDSTASH_NO_PDL=1``. Either way the kernels write the
    same bits; PDL only hides a launch.

    The variable is read at every launch (a CUDA graph keeps the launches it captured); a
    value other than 1/true/yes or 0/false/no (or empty) is a `ValueError`.
    """
    text = os.environ.get(PDL_OFF_ENV, "")
    off = _OFF.get(text.strip().lower())
    if off is None:
        raise ValueError(f"{PDL_OFF_ENV}={text!r}: set it to 1 to turn programmatic dependent "
                         f"launch off, or to 0 (or unset it) to leave it on")
    if off or device.type != "cuda" or torch.version.hip is not None:
        return False
    return _capability(_index(device)) >= (9, 0)


def _index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device for a bare "cuda"): the key
    the per-device caches take."""
    return torch.cuda.current_device() if device.index is None else device.index


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
