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


def _stash_setup(rows, hidden, dtype, page_size, device):
    cfg = StashConfig(capacity_factor=1.0, paged_stash=True, page_size=page_size,
                      cuda_factor=1.0)
    state = init_stash_state([StashSpec("x", hidden, dtype, rows, rows)], cfg, device=device)
    src = torch.randn(rows, hidden, device=device).to(dtype)
    n = torch.tensor([rows], dtype=torch.int32, device=device)
    return state, src, n


def _graph_seconds(fn, reps: int, replays: int = 10) -> float:
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
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(times)


def bench_stash(hiddens, rows_list, dtype_name="bf16", page_size=64, iters=20, device=None,
                launch=(0, 0), quiet=False):
    """Print and return stash/pop bandwidth against ``copy_`` per (H, rows), all rows valid.

    Device time from CUDA-graph replays: a stash is replayed with a reset of its 16-byte cursor
    tensor after it, a pop with a reset of its page table and cursors; the time of the resets
    alone is measured the same way and subtracted. ``eager us`` is the wall time per
    stash+pop pair launched eagerly back to back (CPU launch cost included).
    """
    device = torch.device(device or "cuda")
    if device.type != "cuda":
        raise ValueError("bench stash times CUDA kernels; run it on a GPU (--device cuda)")
    dtype = _DTYPES[dtype_name]
    block, programs = launch
    results = []
    if not quiet:
        print(f"device: {_device_name(device)}; dtype {dtype_name}; page {page_size}; "
              f"launch block={block or 'auto'} programs={programs or 'auto'}; "
              f"device time from CUDA-graph replays")
        print(f"{'H':>6} {'rows':>7} {'MB':>7} {'copy_ GB/s':>10} {'stash GB/s':>10} "
              f"{'pop GB/s':>9} {'stash/copy':>10} {'pop/copy':>9} {'eager us':>9}")
    for hidden, rows in itertools.product(hiddens, rows_list):
        state, src, n = _stash_setup(rows, hidden, dtype, page_size, device)
        table, cuda, host, free, cursors, flags = stash_tensors(state, "x")
        dst = torch.empty_like(src)
        nbytes = 2 * src.numel() * src.element_size()

        def stash():
            kernels.stash_copy(src, n, table, cuda, host, free, cursors, flags, page_size,
                               "auto", block, programs)

        def pop():
            return kernels.stash_pop(table, cuda, host, free, cursors, rows, page_size,
                                     "auto", block, programs)

        empty_cursors = cursors.clone()
        stash()
        full_table, full_cursors = table.clone(), cursors.clone()
        pop()

        def stash_and_reset():
            stash()
            cursors.copy_(empty_cursors)

        def reset_after_stash():
            cursors.copy_(empty_cursors)

        def pop_and_reset():
            pop()
            table.copy_(full_table)
            cursors.copy_(full_cursors)

        def reset_after_pop():
            table.copy_(full_table)
            cursors.copy_(full_cursors)

        t_copy = _graph_seconds(lambda: dst.copy_(src), iters)
        t_stash = _graph_seconds(stash_and_reset, iters) - _graph_seconds(reset_after_stash,
                                                                          iters)
        cursors.copy_(full_cursors)
        table.copy_(full_table)
        t_pop = _graph_seconds(pop_and_reset, iters) - _graph_seconds(reset_after_pop, iters)
        torch.cuda.synchronize()
        if not torch.equal(pop()[:rows], src):
            raise RuntimeError("stash/pop round trip lost data during the benchmark")
        cursors.copy_(empty_cursors)
        eager = _eager_pair_seconds(stash, pop, iters)
        row = dict(hidden=hidden, rows=rows, mb=nbytes / 2 / 1e6,
                   copy_gbs=nbytes / t_copy / 1e9, stash_gbs=nbytes / t_stash / 1e9,
                   pop_gbs=nbytes / t_pop / 1e9, stash_ratio=t_copy / t_stash,
                   pop_ratio=t_copy / t_pop, eager_us=eager * 1e6)
        results.append(row)
        if not quiet:
            print(f"{hidden:>6} {rows:>7} {row['mb']:>7.1f} {row['copy_gbs']:>10.0f} "
                  f"{row['stash_gbs']:>10.0f} {row['pop_gbs']:>9.0f} "
                  f"{row['stash_ratio']:>9.1%} {row['pop_ratio']:>8.1%} "
                  f"{row['eager_us']:>9.1f}", flush=True)
        torch.cuda.empty_cache()
    return results


def _eager_pair_seconds(stash, pop, iters: int) -> float:
    for _ in range(3):
        stash(), pop()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        stash()
        pop()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def sweep_launch(hiddens, rows_list, dtype_name="bf16", page_size=64, iters=20, device=None):
    """Try launch sizes on this GPU; print each one's worst and mean ratio to ``copy_``."""
    device = torch.device(device or "cuda")
    props = torch.cuda.get_device_properties(device)
    cap = (props.major, props.minor)
    saved = kernels._launch.BY_CAPABILITY.get(cap)
    scores = []
    try:
        for tile, warps, evict in itertools.product([16384, 32768], [4, 8], [True, False]):
            resident = 64 // warps     # warps an SM holds / warps per program
            for per_sm in (resident // 2, resident, None):   # None: a program per tile
                kernels._launch.BY_CAPABILITY[cap] = (tile, per_sm, warps, evict)
                kernels._launch.cuda_defaults.cache_clear()
                rows = bench_stash(hiddens, rows_list, dtype_name, page_size, iters, device,
                                   quiet=True)
                worst = min(min(r["stash_ratio"], r["pop_ratio"]) for r in rows)
                mean = statistics.mean((r["stash_ratio"] + r["pop_ratio"]) / 2 for r in rows)
                scores.append((worst, mean, (tile, per_sm, warps, evict)))
                print(f"tile {tile:>6} B  {per_sm or 'tile':>4} programs/SM  {warps} warps  "
                      f"evict_first={evict!s:<5}  worst {worst:.1%}  mean {mean:.1%}",
                      flush=True)
    finally:
        if saved is None:
            kernels._launch.BY_CAPABILITY.pop(cap, None)
        else:
            kernels._launch.BY_CAPABILITY[cap] = saved
        kernels._launch.cuda_defaults.cache_clear()
    scores.sort(key=lambda s: (s[0], s[1]), reverse=True)
    print("best by worst-case ratio (tile bytes, programs/SM, warps, evict_first):")
    for worst, mean, key in scores[:3]:
        print(f"  {key}: worst {worst:.1%}, mean {mean:.1%}")
    return scores


def _device_name(device):
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} (SM {p.major}.{p.minor}, {p.multi_processor_count} SMs)"
    return "cpu"


def bench_moe(tokens=8192, hidden=2048, ffn=1408, experts=64, top_k=6, capacity_factor=1.25,
              expert_ranks=8, iters=10, device=None, dtype_name="bf16", seed=0,
              pad_fraction=0.0, cuda_factor=1.10, profile=False, layers=1):
    """Forward+backward time and peak memory of ``layers`` MoE layers on three paths.

    Paths, in one process: exact (dropless, one host read per layer), capacity without stash
    and capacity with paged stash, the last two through `stash_aware` + `run_step` (so the
    capacity figures include the one flag read and any rerun). Peak memory is what a step adds
    above parameters and inputs; the stash pools, allocated before the step, are counted in.
    ``pad_fraction`` of the tokens are routed to padding (id -1), as masked tokens of a packed
    batch would be.
    """
    from ._moe import moe, moe_init
    from ._routing import route
    from ._runner import run_step
    from ._transform import stash_aware
    device = torch.device(device or "cuda")
    if device.type != "cuda":
        raise ValueError("bench moe times CUDA work; run it on a GPU")
    dtype = _DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    params = [moe_init(experts, hidden, ffn, generator=gen, dtype=dtype, device=device)
              for _ in range(layers)]
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    cotangent = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    n_pad = int(pad_fraction * tokens)
    padding = torch.zeros(tokens, dtype=torch.bool)
    padding[torch.randperm(tokens, generator=gen)[:n_pad]] = True
    batch = {"x": x, "cotangent": cotangent, "padding": padding.to(device)}

    def loss_fn(params, batch):
        h = batch["x"]
        for p in params:
            ids, weights = route(p["router"], h, top_k)
            ids = torch.where(batch["padding"][:, None], -1, ids)
            h = h + moe(p, h, top_k=top_k, routing=(ids, weights))
        return (h.float() * batch["cotangent"].float()).sum()

    flops = layers * 3 * 2 * (tokens - n_pad) * top_k * (hidden * 2 * ffn + ffn * hidden)
    print(f"device: {_device_name(device)}; {layers} layer(s) of T={tokens} H={hidden} F={ffn} "
          f"E={experts} k={top_k} {dtype_name}; {n_pad} padding tokens; capacity_factor="
          f"{capacity_factor} expert_ranks={expert_ranks} cuda_factor={cuda_factor}; "
          f"{flops / 1e12:.2f} TFLOP of expert GEMMs per step")
    exact_grad = torch.func.grad(loss_fn)

    def runner(stash):
        if stash is None:
            return (lambda: exact_grad(params, batch)), None
        cfg = StashConfig(capacity_factor=capacity_factor, paged_stash=stash,
                          expert_ranks=expert_ranks, cuda_factor=cuda_factor)
        step = stash_aware(loss_fn, cfg)
        box = {"state": step.init(params, batch), "reruns": 0, "reasons": set()}

        def run():
            res = run_step(step, params, batch, box["state"])
            box["state"] = res.state
            box["reruns"] += res.report.reran
            box["reasons"].update(res.report.reasons)
            return res.grads
        return run, box

    def held_after_forward(stash):
        """Bytes kept between forward and backward (pools counted in), via torch.func.vjp."""
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        if stash is None:
            out = torch.func.vjp(lambda p: loss_fn(p, batch), params)
        else:
            cfg = StashConfig(capacity_factor=capacity_factor, paged_stash=stash,
                              expert_ranks=expert_ranks, cuda_factor=cuda_factor)
            step = stash_aware(loss_fn, cfg)
            state = step.init(params, batch)
            out = torch.func.vjp(lambda p: step(p, batch, state), params, has_aux=True)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        del out
        return held

    rows = []
    for name, stash in (("exact", None), ("capacity", False), ("capacity+stash", True)):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        run, box = runner(stash)
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        if box:
            box["reruns"] = 0
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        if profile:
            _print_profile(name, run)
        note = (f"{box['reruns']}/{iters} reran {sorted(box['reasons'])}" if box else "-")
        del box, run
        held = held_after_forward(stash)
        rows.append((name, statistics.median(times), peak, held, note))
    t0, m0, h0 = rows[0][1], rows[0][2], rows[0][3]
    print("peak: most memory a step adds; held: what stays between forward and backward")
    print(f"{'path':<16} {'ms':>8} {'TFLOP/s':>8} {'x exact':>8} {'peak MiB':>9} "
          f"{'x exact':>8} {'held MiB':>9} {'x exact':>8}  reruns")
    for name, t, peak, held, note in rows:
        print(f"{name:<16} {t * 1e3:>8.2f} {flops / t / 1e12:>8.0f} {t / t0:>8.2f} "
              f"{peak / 2**20:>9.0f} {peak / m0:>8.2f} {held / 2**20:>9.0f} {held / h0:>8.2f}"
              f"  {note}")
    return rows


def _print_profile(name, run, rows=14):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(f"--- {name}: CUDA time by kernel")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows,
                                    max_name_column_width=60))
