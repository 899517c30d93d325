"""`bench stash`: bandwidth of the stash and pop kernels next to `Tensor.copy_` of the same bytes.

In one process, so the ratio is what to read. Bytes counted: a copy of ``rows x H`` elements
reads and writes them once each (``2 * rows * H * itemsize``); stash and pop with every row
valid move exactly the same bytes. Device time comes from CUDA-graph replays.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import statistics

import torch

import pagedstash_func as psf

from ._common import (
    DTYPES, capture_graph, cuda_device, device_name, event_seconds, replay_seconds,
)
from ._anchor import load_anchor, measure_anchor


def bench_stash(hiddens, rows_list, dtype_name="bf16", page_size=64, iters=20, device=None,
                launch=(0, 0, 0), quiet=False, valid=1.0, anchor=None, expected=(1.0,),
                pdl=("on",), floor=False, rounds=5):
    """Print and return stash/pop bandwidth against ``copy_`` per (H, rows, expected).

    ``rows`` rows are valid in a buffer of ``ceil(rows / valid)`` rows (the capacity); every
    figure counts the valid bytes only, and ``copy_`` copies exactly those. The pop is the
    layer's (no zeroed tail: its consumers read only valid rows). The kernels are told to
    expect ``f * rows`` rows per factor ``f`` of ``expected`` (as the layer tells them its
    balanced rows; the grid covers 3/4 of them, `kernels.grid_size`), nothing when ``f`` is 0
    (a grid for the capacity); each row times its own ``copy_`` in the same rounds as its
    kernels.

    A stash is replayed with a reset of its 16-byte cursor tensor after it, a pop with a reset
    of its page table and cursors; the resets alone are timed the same way and subtracted.
    Each path is captured once and replayed in ``rounds`` interleaved rounds (copy_, stash,
    its reset, pop, ...); a share is the median over rounds of the round's ``copy_`` time over
    the path's (timed once, the first stash of a process read about 3 points fast at 8192
    rows of 2048 on the H200: 2.3-3.3 within one process).
    ``eager us`` is the wall time per stash+pop pair launched eagerly back to back.
    ``launch`` = (elements per tile, programs, warps), 0 for the per-device choice.
    ``anchor``: the root of a Megatron-LM checkout; its paged-stash kernels are then timed in
    the same process (`_bench_anchor`, once per shape, against the ``copy_`` time of the
    shape's first row) and a second table compares them with ours. ``pdl``:
    "on" and/or "off", one table row each: the second launch of the stash and of the pop with
    programmatic dependent launch where the device has it (`kernels.use_pdl`), or without; it
    overrides ``PAGEDSTASH_NO_PDL``, and the PDL column says what each row used. ``floor``:
    also time `kernels.floor_copy_triton` (a bare copy of the valid bytes in the writer's and
    the reader's tiles: alone, after a one-program launch and before one, with the row's PDL
    mode) in the same rounds, and print a table of them beside the stash and the pop.
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: pass 1 or more interleaved rounds")
    anchor_kernels = None if anchor is None else load_anchor(anchor)   # first, also on a CPU
    device = cuda_device(device, "bench stash")
    if not quiet:
        _print_header(device, dtype_name, page_size, valid, launch)
    results = []
    for hidden, rows in itertools.product(hiddens, rows_list):
        theirs = None
        for factor, mode in itertools.product(expected, pdl):
            with _pdl(mode):
                row = _measure(hidden, rows, DTYPES[dtype_name], page_size, iters, device,
                               launch, valid, max(1, round(factor * rows)) if factor else 0,
                               rounds, floor)
                used = "on" if psf.kernels.use_pdl(device) else "off"
            row["expected"], row["pdl"] = factor, used
            if anchor_kernels and theirs is None:
                theirs = measure_anchor(anchor_kernels, hidden, rows, DTYPES[dtype_name],
                                        page_size, iters, device, valid, row["copy_s"])
            row["anchor"] = theirs
            results.append(row)
            if not quiet:
                _print_row(row)
        torch.cuda.empty_cache()
    if anchor_kernels and not quiet:
        _print_anchor(results, anchor_kernels)
    if floor and not quiet:
        _print_floor(results)
    return results


KEY_HEAD = f"{'H':>6} {'rows':>7} {'expected':>9} {'PDL':>4}"   # the columns that name a row


def _key(row) -> str:
    """The columns of `KEY_HEAD` for one result row; every table of the bench starts with them."""
    return f"{row['hidden']:>6} {row['rows']:>7} {_told(row['expected']):>9} {row['pdl']:>4}"


def _print_row(row) -> None:
    print(f"{_key(row)} {row['mb']:>7.1f} {row['copy_gbs']:>10.0f} {row['stash_gbs']:>10.0f} "
          f"{row['pop_gbs']:>9.0f} {row['stash_ratio']:>9.1%} {row['pop_ratio']:>8.1%} "
          f"{row['eager_us']:>9.1f}", flush=True)


def _print_header(device, dtype_name, page_size, valid, launch) -> None:
    print(f"device: {device_name(device)}; dtype {dtype_name}; page {page_size}; "
          f"{valid:.0%} of rows valid; launch "
          f"(block, programs, warps) = {tuple(x or 'auto' for x in launch)}; programmatic "
          f"dependent launch {'available' if _has_pdl(device) else 'unavailable'}; "
          f"device time from CUDA-graph replays")
    print(f"{KEY_HEAD} {'MB':>7} {'copy_ GB/s':>10} "
          f"{'stash GB/s':>10} {'pop GB/s':>9} {'stash/copy':>10} {'pop/copy':>9} "
          f"{'eager us':>9}")


@contextlib.contextmanager
def _pdl(mode: str):
    """Programmatic dependent launch on ("on": where the device has it) or off, for a block."""
    if mode not in ("on", "off"):
        raise ValueError(f"pdl modes are 'on' and 'off', got {mode!r}")
    before = os.environ.get(psf.kernels.PDL_OFF_ENV)
    os.environ[psf.kernels.PDL_OFF_ENV] = "1" if mode == "off" else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[psf.kernels.PDL_OFF_ENV]
        else:
            os.environ[psf.kernels.PDL_OFF_ENV] = before


def _has_pdl(device) -> bool:
    with _pdl("on"):
        return psf.kernels.use_pdl(device)


def _told(factor: float) -> str:
    """The ``expected`` column: rows the kernels were told, over the valid rows."""
    return f"{factor:g}x" if factor else "none"


def _print_anchor(results, kernels) -> None:
    tail = "with" if kernels["pop_tail"] else "without"
    print(f"anchor: Megatron-LM at commit {kernels['commit']} (its pop {tail} the tail option)")
    print("anchor (Megatron-Core's paged stash), the better of its two launch settings, against "
          "the copy_ time of the shape's first row; 'launched' adds the copy_ that its launcher "
          "runs to publish the new free-list head / tail; ours / anchor (our share of copy_ "
          "over the anchor's) is read against the kernel alone")
    print(f"{KEY_HEAD} {'stash/copy':>10} {'pop/copy':>9} "
          f"{'launched':>9} {'launched':>9} {'ours/anchor stash':>18} {'pop':>6}")
    for r in results:
        a = r["anchor"]
        print(f"{_key(r)} "
              f"{a['stash_kernel']:>9.1%} {a['pop_kernel']:>8.1%} "
              f"{a['stash_launched']:>8.1%} {a['pop_launched']:>8.1%} "
              f"{r['stash_ratio'] / a['stash_kernel']:>18.2f} "
              f"{r['pop_ratio'] / a['pop_kernel']:>6.2f}", flush=True)


def _print_floor(results) -> None:
    print("floor: a bare copy of the same bytes in the page writer's tiles ('alone'; 'word "
          "first': after a one-program launch that it waits for before it stores, as the "
          "writer waits for the reserve) and in the page reader's ('word after': before a "
          "one-program launch that waits for it, as the release waits for the reader); no "
          "page table, so a two-launch stash should not beat 'word first', nor a two-launch "
          "pop 'word after', by more than the spread of the timings")
    print(f"{KEY_HEAD} {'alone':>7} {'word first':>11} "
          f"{'stash':>7} {'word after':>11} {'pop':>7}")
    for r in results:
        f = r["floor"]
        print(f"{_key(r)} "
              f"{f['alone']:>7.1%} {f['word first']:>11.1%} {r['stash_ratio']:>7.1%} "
              f"{f['word after']:>11.1%} {r['pop_ratio']:>7.1%}", flush=True)


def _measure(hidden, rows, dtype, page_size, iters, device, launch, valid=1.0,
             expected_rows=0, rounds=5, floor=False) -> dict:
    capacity = math.ceil(rows / valid)
    cfg = psf.StashConfig(capacity_factor=1.0, paged_stash=True, page_size=page_size,
                          cuda_factor=1.0)
    state = psf.init_stash_state([psf.StashSpec("x", hidden, dtype, capacity, rows)], cfg,
                                 device=device)
    slot, flags = psf.stash_slot(state, "x"), state.flags
    src = torch.randn(capacity, hidden, device=device).to(dtype)
    n = torch.tensor([rows], dtype=torch.int32, device=device)
    dst = torch.empty_like(src[:rows])

    def stash():
        psf.kernels.stash_copy(src, n, *slot, flags, page_size, "auto", *launch, expected_rows)

    def pop():
        return psf.kernels.stash_pop(*slot, capacity, page_size, "auto", *launch, False,
                                     expected_rows)

    empty_cursors = slot.cursors.clone()
    stash()
    full_table, full_cursors = slot.table.clone(), slot.cursors.clone()
    pop()
    after_stash = lambda: slot.cursors.copy_(empty_cursors)    # noqa: E731

    def after_pop():
        slot.table.copy_(full_table)
        slot.cursors.copy_(full_cursors)

    paths = {"copy": (_nothing, lambda: dst.copy_(src[:rows])),
             "stash": (after_stash, lambda: (stash(), after_stash())),
             "after stash": (after_stash, after_stash),
             "pop": (after_pop, lambda: (pop(), after_pop())),
             "after pop": (after_pop, after_pop)}
    if floor:
        paths.update(_floor_paths(src[:rows], dst, capacity, page_size, expected_rows, launch))
    seconds, graphs = _time_rounds(paths, iters, rounds)
    if flags.any():
        raise RuntimeError("a timed stash overflowed its pool: the figures would time copies "
                           "that never happened")
    # The graph that was timed, replayed once more into a zeroed pool, must have written it.
    slot.cuda.zero_()
    after_stash()
    graphs["stash"].replay()
    slot.cursors.copy_(full_cursors)
    if not torch.equal(pop()[:rows], src[:rows]):
        raise RuntimeError("stash/pop round trip lost data during the benchmark")
    after_stash()
    for _ in range(3):
        stash(), pop()
    eager = event_seconds(lambda: [(stash(), pop()) for _ in range(iters)]) / iters
    return _row(hidden, rows, expected_rows, dst, seconds, eager, floor)


def _nothing() -> None:
    pass


def _floor_paths(src, out, capacity, page_size, expected_rows, launch) -> dict:
    """The `kernels.FLOOR_SHAPES` copies of ``src`` into ``out`` as bench paths: "alone" and
    "word first" in the page writer's tiles, warps and grid, "word after" in the page
    reader's (`kernels.choose_launch` with the bench's ``launch`` overrides,
    `kernels.grid_size` for a buffer of ``capacity`` rows told ``expected_rows``); each
    checked once."""
    word = torch.zeros(2, dtype=torch.int32, device=src.device)
    paths = {}
    for shape in psf.kernels.FLOOR_SHAPES:
        kernel = "pop" if shape == "word after" else "stash"
        sizes = psf.kernels.choose_launch(src.device, src.shape[1], src.element_size(),
                                          page_size, *launch, kernel=kernel)
        programs = psf.kernels.grid_size(capacity, src.shape[1], page_size, sizes.block,
                                         sizes.programs, expected_rows)
        copy = functools.partial(psf.kernels.floor_copy_triton, src, out, word, shape,
                                 sizes.block, sizes.num_warps, programs)
        out.zero_()
        copy()
        if not torch.equal(out, src):
            raise RuntimeError(f"the floor copy ({shape}) lost data during the benchmark")
        paths[f"floor {shape}"] = (_nothing, copy)
    return paths


def _time_rounds(paths: dict, iters: int, rounds: int) -> tuple[dict, dict]:
    """Seconds per call of each path ``{name: (prep, fn)}`` in each of ``rounds`` rounds:
    every path is captured once, then the graphs are replayed in turn, round after round,
    each after its ``prep`` (run outside the graph: it puts the state where the path
    starts). Returns the seconds and the graphs."""
    graphs = {}
    for name, (prep, fn) in paths.items():
        prep()
        graphs[name] = capture_graph(fn, iters)
    seconds = {name: [] for name in paths}
    for _ in range(rounds):
        for name, (prep, _) in paths.items():
            prep()
            seconds[name].append(replay_seconds(graphs[name], iters))
    return seconds, graphs


def _row(hidden, rows, expected_rows, dst, seconds, eager, floor) -> dict:
    """A table row: each share of ``copy_`` is the median over rounds of the round's ratio
    (a stash's or pop's time less its reset's); ``copy_s`` is the median ``copy_`` time, and
    the GB/s columns are ``copy_``'s median bandwidth times those shares."""
    copy = seconds["copy"]

    def share(name, less=None):
        spent = [t - (seconds[less][i] if less else 0.0) for i, t in enumerate(seconds[name])]
        return statistics.median(c / t for c, t in zip(copy, spent))
    nbytes = 2 * dst.numel() * dst.element_size()
    t_copy = statistics.median(copy)
    row = dict(hidden=hidden, rows=rows, expected_rows=expected_rows, mb=nbytes / 2 / 1e6,
               copy_s=t_copy, copy_gbs=nbytes / t_copy / 1e9,
               stash_ratio=share("stash", "after stash"), pop_ratio=share("pop", "after pop"),
               eager_us=eager * 1e6)
    row["stash_gbs"] = row["copy_gbs"] * row["stash_ratio"]
    row["pop_gbs"] = row["copy_gbs"] * row["pop_ratio"]
    if floor:
        row["floor"] = {shape: share(f"floor {shape}") for shape in psf.kernels.FLOOR_SHAPES}
    return row


def sweep_launch(hiddens, rows_list, dtype_name="bf16", page_size=64, iters=20, device=None,
                 rounds=3):
    """Try launch sizes on this GPU; print each one's worst and mean ratio to ``copy_``, for
    the stash's page writer and the pop apart (they get separate entries in
    `kernels._launch.BY_CAPABILITY`)."""
    device = cuda_device(device, "bench stash --sweep")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    element = torch.empty((), dtype=DTYPES[dtype_name]).element_size()
    scores = {"stash": [], "pop": []}
    for tile, warps in itertools.product([2048, 4096, 8192, 16384, 32768], [4, 8]):
        resident = 64 // warps     # warps an SM holds / warps per program
        for per_sm in (resident // 2, resident, None):   # None: a program per tile
            programs = per_sm * sms if per_sm else psf.kernels.ONE_PER_TILE
            launch = (tile // element, programs, warps)
            rows = bench_stash(hiddens, rows_list, dtype_name, page_size, iters, device,
                               launch=launch, quiet=True, rounds=rounds)
            line = f"tile {tile:>6} B  {per_sm or 'tile':>4} programs/SM  {warps} warps"
            for kernel in scores:
                ratios = [r[f"{kernel}_ratio"] for r in rows]
                worst, mean = min(ratios), statistics.mean(ratios)
                scores[kernel].append((worst, mean, (tile, per_sm, warps)))
                line += f"  {kernel}: worst {worst:.1%} mean {mean:.1%}"
            print(line, flush=True)
    for kernel, rows in scores.items():
        rows.sort(key=lambda s: (s[0], s[1]), reverse=True)
        print(f"best for the {kernel} by worst-case ratio (tile bytes, programs/SM, warps):")
        for worst, mean, key in rows[:3]:
            print(f"  {key}: worst {worst:.1%}, mean {mean:.1%}")
    return scores
