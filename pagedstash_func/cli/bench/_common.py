"""What every benchmark shares: dtypes by name, the device check, and how time and memory are
measured. Benchmarks sit behind the CLI (`python -m pagedstash_func bench ...`) and use the
public API; the tests never time anything.
"""

from __future__ import annotations

import statistics

import torch

import pagedstash_func as psf

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
POOL_SCOPES = ("state", "layer")     # the values of psf.StashConfig.pool_scope


def pool_scopes_of(pool_scopes) -> tuple:
    """The `StashConfig.pool_scope` values a bench runs, each once, in order (a string is one
    scope); `ValueError` naming the fix before anything is timed."""
    scopes = (pool_scopes,) if isinstance(pool_scopes, str) else tuple(pool_scopes)
    scopes = tuple(dict.fromkeys(scopes))
    if not scopes or any(s not in POOL_SCOPES for s in scopes):
        raise ValueError(f"pool_scopes={pool_scopes!r}: pass 'state', 'layer' or both")
    return scopes


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
    return replay_seconds(capture_graph(fn, reps), reps, replays)


def capture_graph(fn, reps: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``reps`` back-to-back calls of ``fn`` (called once on a side stream
    first, as capture needs), replayed once."""
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
    return graph


def replay_seconds(graph: torch.cuda.CUDAGraph, reps: int, replays: int = 10) -> float:
    """Median seconds of one of the ``reps`` calls in ``graph``, over ``replays`` replays."""
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


def largest_fitting(fits, limit: int | None = None) -> int:
    """The largest ``n >= 1`` for which ``fits(n)`` holds (0 if ``fits(1)`` does not), for a
    ``fits`` that holds up to some ``n`` and not beyond: doubling from 1, then bisection,
    each ``n`` asked once, in that order; below ``limit`` when one is given (``limit``
    itself is never asked)."""
    low, high = 0, 1
    while limit is None or high < limit:
        if not fits(high):
            break
        low, high = high, 2 * high
    else:
        high = limit
    while high - low > 1:                      # fits(low) (or low is 0), not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def print_profile(name, fn, rows=14) -> dict[str, float]:
    """CUDA time per kernel of one ``fn()``, from the torch profiler, printed; returns the
    seconds by kind of kernel (`kernel_kinds`)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    print(f"--- {name}: CUDA time by kernel")
    print(events.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))
    return kernel_kinds(kernel_seconds(events))


def kernel_seconds(events) -> dict[str, float]:
    """Seconds on the device by kernel (and copy) name from the profiler's averaged events:
    the device's own events only, annotations of regions left out (they span kernels
    already counted)."""
    return {e.key: e.self_device_time_total / 1e6 for e in events
            if str(e.device_type).endswith("CUDA")
            and not getattr(e, "is_user_annotation", False)}


LM_LOSS, PSF = "LM loss (psf's cross-entropy)", "psf's Triton kernels"
# the other kinds of kernel by name, the first pattern that matches (case-insensitive); the
# compiler's fused kernels first, whose names carry the ops they fuse ("..._flash_attention_...")
KERNEL_KINDS = (
    (LM_LOSS, None),
    (PSF, None),
    ("fused by the compiler", r"^triton_(poi|red|per|for)_"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("GEMM", r"gemm|cutlass|xmma|nvjet|cublas|matmul|triton_tem_"),
    ("copies, casts and fills", r"memcpy|memset|direct_copy|catarray|fillfunctor"),
    ("NCCL", r"nccl"),
    ("other (eager elementwise, reductions, indexing)", r""),
)


def psf_kernel_names() -> frozenset:
    """The names psf's Triton kernels run under (their ``@triton.jit`` functions' names, read
    from `pagedstash_func.kernels`' modules, compiled or under the interpreter; none without
    Triton)."""
    import importlib
    import pkgutil
    jitted = ("JITFunction", "InterpretedFunction")
    names = set()
    for info in pkgutil.iter_modules(psf.kernels.__path__):
        module = importlib.import_module(f"{psf.kernels.__name__}.{info.name}")
        names.update(v.fn.__name__ for v in vars(module).values()
                     if type(v).__name__ in jitted and callable(getattr(v, "fn", None)))
    return frozenset(names)


def kernel_kinds(seconds: dict[str, float], psf_names=None) -> dict[str, float]:
    """Seconds by kind of kernel (`KERNEL_KINDS`, in its order) from seconds by kernel name;
    kinds with no kernel left out. ``psf_names``: psf's kernels' names (default
    `psf_kernel_names`), matched whole."""
    import re
    psf_names = psf_kernel_names() if psf_names is None else psf_names
    out = dict.fromkeys((kind for kind, _ in KERNEL_KINDS), 0.0)
    for name, s in seconds.items():
        if name in psf_names:
            kind = LM_LOSS if name == "_cross_entropy_rows_kernel" else PSF
        else:
            kind = next(k for k, pattern in KERNEL_KINDS
                        if pattern is not None and re.search(pattern, name, re.I))
        out[kind] += s
    return {k: v for k, v in out.items() if v}


def path_runner(loss_fn, params, batch, cfg, graph: bool = False, compiled: bool = False):
    """``(run, box)``: ``run()`` does one step and returns its grads; exact when ``cfg`` is
    None (``box`` None), else `run_step` (one flag read, rerun if flagged; with ``graph``,
    `psf.graphed`; with ``compiled``, a `psf.compile` step), counting reruns in ``box``
    (which also holds the step)."""
    if cfg is None:
        grad = torch.func.grad(loss_fn)
        return (lambda: grad(params, batch)), None
    step = psf.stash_aware(loss_fn, cfg)
    step = psf.compile(step) if compiled else step
    box = {"state": step.init(params, batch), "reruns": 0, "reasons": set(), "step": step}
    run_step = psf.graphed(step) if graph else (lambda *a: psf.run_step(step, *a))

    def run():
        res = run_step(params, batch, box["state"])
        box["state"] = res.state
        box["reruns"] += res.report.reran
        box["reasons"].update(res.report.reasons)
        return res.grads
    return run, box


def held_after_forward(loss_fn, params, batch, cfg, backward: bool = False,
                       step=None) -> int:
    """Bytes kept between forward and backward (pools counted in), via `torch.func.vjp`; for
    a compiled ``step`` (`psf.compile`, which torch.func cannot take), its attempt and then
    ``torch.autograd.grad``.

    ``backward``: run the pullback afterwards (expert-parallel layers must, on every rank).
    """
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    if getattr(step, "compiled", False):
        params = torch.utils._pytree.tree_map(lambda t: t.detach().requires_grad_(), params)
        leaves = torch.utils._pytree.tree_leaves(params)
        loss, state = step.attempt(params, batch, step.init(params, batch))
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        torch.autograd.grad(loss, leaves)
        return held
    if cfg is None:
        out = torch.func.vjp(lambda p: loss_fn(p, batch), params)
    else:
        step = psf.stash_aware(loss_fn, cfg)
        state = step.init(params, batch)
        out = torch.func.vjp(lambda p: step(p, batch, state), params, has_aux=True)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    if backward:
        out[1](torch.ones((), device=out[0].device, dtype=out[0].dtype))
    del out
    return held
