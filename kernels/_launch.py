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
from typing import NamedTuple

import torch


class Launch(NamedTuple):
    block: int          # elements per tile (a power of two)
    programs: int       # most programs in the grid
    num_warps: int


ONE_PER_TILE = 1 << 31   # `programs` that never caps the grid: a program per tile

# Per compute capability and kernel ("stash": the page writer after `stash_reserve`; "pop"):
# (bytes per tile, programs per SM or None for one program per tile, warps). Only measured
# entries belong here. SM 9.0, on the H200 (`bench stash`, and `bench stash --sweep`):
# - the pop takes a ticket per program (see `_pagestack.is_last_program`), so its tiles are
#   large: 16 KiB and 8 warps, a program per tile of the expected rows (sweep: worst case
#   89.4 % of copy_, mean 96.8 %, against 88.3 % and 94.0 % for 32 KiB tiles, the choice
#   while grids covered the capacity; tiles of 2-4 KiB: 37-74 % worst case, from the ticket);
#   an evict_first hint cost 1-4 %;
# - the stash's page writer takes no ticket (its bookkeeping is a launch of its own), so it
#   moves small tiles, which stream at copy_'s speed: bare flat copies of 2 and 4 KiB tiles
#   measured 99-100 % of copy_ where 32 KiB tiles measured 94-97 %.
# Other devices get the anchor's default: 1024 bf16 elements per tile and about 2048 programs
# (16 per SM on a 132-SM part).
BY_CAPABILITY: dict[tuple[int, int], dict[str, tuple[int, int | None, int]]] = {
    (9, 0): {"stash": (2048, None, 4), "pop": (16384, None, 8)},
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
        tile_bytes, auto_programs, auto_warps = cuda_defaults(device.index, kernel)
    else:
        tile_bytes, auto_programs, auto_warps = _CPU
    auto_block = max(16, tile_bytes // element_size)
    auto_block = min(auto_block, max(16, _next_pow2(page_size * width)))
    return Launch(block=_next_pow2(block) if block > 0 else auto_block,
                  programs=programs if programs > 0 else auto_programs,
                  num_warps=warps if warps > 0 else auto_warps)


@functools.lru_cache(maxsize=None)
def cuda_defaults(index: int | None, kernel: str) -> tuple[int, int, int]:
    """(bytes per tile, programs, warps) of ``kernel`` on one CUDA device, from
    `BY_CAPABILITY`; cached."""
    index = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(index)
    entry = BY_CAPABILITY.get((props.major, props.minor), {})
    tile_bytes, per_sm, warps = entry.get(kernel, _DEFAULT)
    programs = per_sm * props.multi_processor_count if per_sm else ONE_PER_TILE
    return tile_bytes, programs, warps
