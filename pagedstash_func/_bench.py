"""Benchmarks behind the CLI (`python -m pagedstash_func bench ...`); never run by the tests.

`stash`: bandwidth of the stash and pop kernels next to `Tensor.copy_` of the same bytes, in one
process, so the ratio is what to read. Bytes counted: a copy of ``rows x H`` elements reads and
writes them once each (``2 * rows * H * itemsize``); stash and pop with every row valid move
exactly the same bytes.
"""

from __future__ import annotations

import itertools
import statistics

import torch

from . import kernels
from ._config import StashConfig
from ._paging import stash_tensors
from ._state import StashSpec, init_stash_state

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _events(device):
    if device.type == "cuda":
        return torch.cuda.Event(enable_timing=True)
    return None


class _Timer:
    """Median wall time of a callable: CUDA events on the GPU, perf_counter elsewhere."""

    def __init__(self, device):
        self.device = device

    def __call__(self, fn, iters: int, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            for _ in range(iters):
                a, b = _events(self.device), _events(self.device)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
        else:
            import time
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def _stash_setup(rows, hidden, dtype, page_size, device):
    cfg = StashConfig(capacity_factor=1.0, paged_stash=True, page_size=page_size,
                      cuda_factor=1.0)
    state = init_stash_state([StashSpec("x", hidden, dtype, rows, rows)], cfg, device=device)
    src = torch.randn(rows, hidden, device=device).to(dtype)
    n = torch.tensor([rows], dtype=torch.int32, device=device)
    return state, src, n


def bench_stash(hiddens, rows_list, dtype_name="bf16", page_size=64, iters=50, device=None,
                launch=(0, 0), quiet=False):
    """Print and return a table of stash/pop bandwidth against ``copy_`` per (H, rows)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _DTYPES[dtype_name]
    block, programs = launch
    timer = _Timer(device)
    results = []
    header = (f"{'H':>6} {'rows':>7} {'MB':>8} {'copy_ GB/s':>11} {'stash GB/s':>11} "
              f"{'pop GB/s':>9} {'stash/copy':>10} {'pop/copy':>9}")
    if not quiet:
        print(f"device: {_device_name(device)}; dtype {dtype_name}; page {page_size}; "
              f"launch override block={block or 'auto'} programs={programs or 'auto'}")
        print(header)
    for hidden, rows in itertools.product(hiddens, rows_list):
        state, src, n = _stash_setup(rows, hidden, dtype, page_size, device)
        table, cuda, host, free, cursors, flags = stash_tensors(state, "x")
        dst = torch.empty_like(src)
        nbytes = 2 * src.numel() * src.element_size()
        t_copy = timer(lambda: dst.copy_(src), iters)

        def stash():
            kernels.stash_copy(src, n, table, cuda, host, free, cursors, flags, page_size,
                               "auto", block, programs)

        def pop():
            return kernels.stash_pop(table, cuda, host, free, cursors, rows, page_size,
                                     "auto", block, programs)

        # Alternate so each stash finds its pages free; time each half separately.
        t_stash, t_pop = [], []
        for _ in range(3):
            stash(), pop()
        for _ in range(iters):
            t_stash.append(timer(stash, 1, warmup=0))
            t_pop.append(timer(pop, 1, warmup=0))
        ts, tp = statistics.median(t_stash), statistics.median(t_pop)
        row = dict(hidden=hidden, rows=rows, mb=nbytes / 2 / 1e6, copy_gbs=nbytes / t_copy / 1e9,
                   stash_gbs=nbytes / ts / 1e9, pop_gbs=nbytes / tp / 1e9,
                   stash_ratio=t_copy / ts, pop_ratio=t_copy / tp)
        results.append(row)
        if not quiet:
            print(f"{hidden:>6} {rows:>7} {row['mb']:>8.1f} {row['copy_gbs']:>11.0f} "
                  f"{row['stash_gbs']:>11.0f} {row['pop_gbs']:>9.0f} "
                  f"{row['stash_ratio']:>9.1%} {row['pop_ratio']:>8.1%}")
    return results


def sweep_launch(hiddens, rows_list, dtype_name="bf16", page_size=64, iters=30, device=None):
    """Try launch sizes; print the worst-case ratio to ``copy_`` of each, best first."""
    device = torch.device(device or "cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else 1
    scores = []
    for block_bytes, per_sm in itertools.product([4096, 8192, 16384, 32768], [4, 8, 16, 32]):
        block = block_bytes // torch.empty((), dtype=_DTYPES[dtype_name]).element_size()
        rows = bench_stash(hiddens, rows_list, dtype_name, page_size, iters, device,
                           (block, per_sm * sms), quiet=True)
        worst = min(min(r["stash_ratio"], r["pop_ratio"]) for r in rows)
        mean = statistics.mean((r["stash_ratio"] + r["pop_ratio"]) / 2 for r in rows)
        scores.append((worst, mean, block_bytes, per_sm))
        print(f"tile {block_bytes:>6} B  {per_sm:>3} programs/SM  worst {worst:.1%}  "
              f"mean {mean:.1%}", flush=True)
    scores.sort(reverse=True)
    print("best (worst-case ratio):", scores[:3])
    return scores


def _device_name(device):
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} (SM {p.major}.{p.minor}, {p.multi_processor_count} SMs)"
    return "cpu"
