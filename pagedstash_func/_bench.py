"""What every benchmark shares: dtypes by name, the device check, and how time and memory are
measured. Benchmarks sit behind the CLI (`python -m pagedstash_func bench ...`) and use the
public API; the tests never time anything.
"""

from __future__ import annotations

import statistics

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cuda_device(device, what: str) -> torch.device:
    """The CUDA device to time on; `ValueError` naming the fix when there is none."""
    device = torch.device(device or "cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"{what} times CUDA kernels and needs a GPU (--device cuda on a "
                         f"machine with CUDA); this one has none")
    return device


def device_name(device: torch.device) -> str:
    p = torch.cuda.get_device_properties(device)
    return f"{p.name} (SM {p.major}.{p.minor}, {p.multi_processor_count} SMs)"


def graph_seconds(fn, reps: int, replays: int = 10) -> float:
    """Median seconds of one ``fn()`` from CUDA-graph replays of ``reps`` back-to-back calls.

    A graph takes CPU launch cost out, so this is the kernels' own time on the device.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    return statistics.median(event_seconds(graph.replay) for _ in range(replays)) / reps


def event_seconds(fn) -> float:
    """Seconds of one ``fn()`` between two CUDA events (host launch cost included)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def median_seconds(fn, iters: int, warmup: int = 2) -> float:
    """Median of ``iters`` timed calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(event_seconds(fn) for _ in range(iters))


def peak_bytes(fn) -> int:
    """The most memory one ``fn()`` adds above what was allocated before it (its outputs,
    while they live, included)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def print_profile(name, fn, rows=14):
    """CUDA time per kernel of one ``fn()``, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"--- {name}: CUDA time by kernel")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows,
                                    max_name_column_width=60))
