"""Launch sizes for the stash kernels, chosen per device and row width.

Both kernels are pure copies, so the only question is how many bytes each program moves per
iteration and how many programs stay resident. A tile is ``block`` contiguous elements inside
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

# Per compute capability: (bytes per tile, programs per SM or None for one program per tile,
# warps). Only measured entries belong here. SM 9.0 was measured on the H200 by
# `python -m pagedstash_func bench stash --sweep --hidden 2048,7168`: a program per tile beat
# every persistent grid (worst case 90.7 % of copy_ against 89.9 %, mean 94.8 % against 91.7 %),
# and an evict_first hint cost 1-4 % (so the kernels carry none). Other devices get the
# anchor's default: 1024 bf16 elements per tile and about 2048 programs (16 per SM on a 132-SM
# part); the anchor's larger 4096 / 8192 for SM 10.x is a lead to measure there, not an entry.
BY_CAPABILITY: dict[tuple[int, int], tuple[int, int | None, int]] = {
    (9, 0): (32768, None, 8),
}
_DEFAULT = (2048, 16, 4)
_CPU = (1024, 8, 4)   # interpreter: fewer, larger programs keep tests fast


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def choose_launch(device: torch.device, width: int, element_size: int, page_size: int,
                  block: int = 0, programs: int = 0, warps: int = 0) -> Launch:
    """Launch sizes for one stash/pop of rows of ``width`` elements of ``element_size`` bytes.

    ``block``, ``programs`` and ``warps`` override the choice when positive (benchmarks, the
    launch sweep and tests pass them explicitly).
    """
    if device.type == "cuda":
        tile_bytes, auto_programs, auto_warps = cuda_defaults(device.index)
    else:
        tile_bytes, auto_programs, auto_warps = _CPU
    auto_block = max(16, tile_bytes // element_size)
    auto_block = min(auto_block, max(16, _next_pow2(page_size * width)))
    return Launch(block=_next_pow2(block) if block > 0 else auto_block,
                  programs=programs if programs > 0 else auto_programs,
                  num_warps=warps if warps > 0 else auto_warps)


@functools.lru_cache(maxsize=None)
def cuda_defaults(index: int | None) -> tuple[int, int, int]:
    """(bytes per tile, programs, warps) for one CUDA device, from `BY_CAPABILITY`; cached."""
    index = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(index)
    tile_bytes, per_sm, warps = BY_CAPABILITY.get((props.major, props.minor), _DEFAULT)
    programs = per_sm * props.multi_processor_count if per_sm else ONE_PER_TILE
    return tile_bytes, programs, warps
