"""`bench moe`: forward+backward time and memory of MoE layers on the exact, capacity and
capacity+stash paths, in one process (ratios to the exact path are what to read)."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

import pagedstash_func as psf

from ._common import (
    DTYPES, cuda_device, device_name, held_after_forward, median_seconds, path_runner, peak_bytes,
    pool_scopes_of, print_profile,
)

SCOPE_NAMES = {"state": "capacity+stash", "layer": "stash, pool per layer"}


def stacked_layers(layers, tokens, hidden, ffn, experts, top_k, dtype, device, seed=0,
                   pad_fraction=0.0):
    """``(params, batch, loss_fn)``: ``layers`` residual MoE layers; ``pad_fraction`` of the
    tokens routed to padding (id -1), as the masked tokens of a packed batch would be."""
    gen = torch.Generator().manual_seed(seed)
    params = [psf.moe_init(experts, hidden, ffn, generator=gen, dtype=dtype, device=device)
              for _ in range(layers)]
    padding = torch.zeros(tokens, dtype=torch.bool)
    padding[torch.randperm(tokens, generator=gen)[:int(pad_fraction * tokens)]] = True
    batch = {"x": torch.randn(tokens, hidden, generator=gen).to(device, dtype),
             "cotangent": torch.randn(tokens, hidden, generator=gen).to(device, dtype),
             "padding": padding.to(device)}

    def loss_fn(params, batch):
        h = batch["x"]
        for p in params:
            ids, weights = psf.route(p["router"], h, top_k)
            ids = torch.where(batch["padding"][:, None], -1, ids)
            h = h + psf.moe(p, h, top_k=top_k, routing=(ids, weights))
        return (h.float() * batch["cotangent"].float()).sum()
    return params, batch, loss_fn


def bench_moe(tokens=8192, hidden=2048, ffn=1408, experts=64, top_k=6, capacity_factor=1.25,
              expert_ranks=8, iters=10, device=None, dtype_name="bf16", seed=0,
              pad_fraction=0.0, cuda_factor=1.10, host_factor=0.0, profile=False, layers=1,
              graph=False, pool_scopes=("state",), rounds=5, compiled=False):
    """Print and return time, peak and held memory of ``layers`` MoE layers: the exact path,
    the capacity path, and a capacity+stash path per pool scope.

    The capacity paths go through `stash_aware` + `run_step` (so their figures include the
    one flag read and any rerun); with ``graph`` they are timed a second time through
    `psf.graphed` (the attempt replayed from a CUDA graph). Peak is what a step adds above
    parameters and inputs; the stash pools, allocated before the step, are counted in (the
    pinned host pool of ``host_factor`` is not device memory and is not). ``pool_scopes``: one
    capacity+stash path per `StashConfig.pool_scope` (``"layer"``: pools of each call's own,
    not allocated before the step, so they count where they are alive).

    With ``graph``, the graphed paths are then timed again in ``rounds`` interleaved rounds
    (capacity, each stash, capacity, ...; ``iters`` calls each), and the stash's cost is the
    median over rounds of its time over the capacity path's of the same round: drift of the
    clock or of a neighbour moves both sides of a round alike, so the ratio holds still where
    two back-to-back medians do not.

    With ``compiled`` the capacity path, and the stash with pools per layer (the scope
    `psf.compile` stashes into), are timed again as `psf.compile` steps; their first call,
    which compiles, is reported beside them.
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: pass 1 or more interleaved rounds")
    configs = _stash_configs(pool_scopes, capacity_factor=capacity_factor,   # bad ones: now
                             expert_ranks=expert_ranks, cuda_factor=cuda_factor,
                             host_factor=host_factor)
    device = cuda_device(device, "bench moe")
    params, batch, loss_fn = stacked_layers(layers, tokens, hidden, ffn, experts, top_k,
                                            DTYPES[dtype_name], device, seed, pad_fraction)
    n_pad = int(batch["padding"].sum())
    flops = layers * 3 * 2 * (tokens - n_pad) * top_k * (hidden * 2 * ffn + ffn * hidden)
    print(f"device: {device_name(device)}; {layers} layer(s) of T={tokens} H={hidden} F={ffn} "
          f"E={experts} k={top_k} {dtype_name}; {n_pad} padding tokens; capacity_factor="
          f"{capacity_factor} expert_ranks={expert_ranks} cuda_factor={cuda_factor} "
          f"host_factor={host_factor}; "
          f"{flops / 1e12:.2f} TFLOP of expert GEMMs per step")
    rows, graphed = [], {}
    base_cfg = next(iter(configs.values()))
    stashes = [(SCOPE_NAMES[scope], scope) for scope in configs]
    paths = [("exact", None), ("capacity", False)] + stashes
    if graph:
        paths += [("capacity (graph)", False)] + [(f"{n} (graph)", s) for n, s in stashes]
    if compiled:    # a shared pool is not what psf.compile stashes into
        layer_cfg = dataclasses.replace(base_cfg, pool_scope="layer", host_factor=0.0)
        configs.setdefault("layer", layer_cfg)
        paths += [("capacity (compiled)", False),
                  (f"{SCOPE_NAMES['layer']} (compiled)", "layer")]
    for name, stash in paths:
        cfg = None if stash is None else configs[stash] if stash else \
            dataclasses.replace(base_cfg, paged_stash=False)
        row, run = _measure_path(name, loss_fn, params, batch, cfg, iters, profile)
        rows.append(row)
        if "graph" in name:
            graphed[name] = run             # kept (with its graph) for the interleaved rounds
        del run
    grad_bytes = sum(t.numel() * t.element_size()
                     for t in torch.utils._pytree.tree_leaves(params))
    _print_rows(rows, flops, grad_bytes)
    if graphed:
        _print_interleaved(graphed, iters, rounds)
    return rows


def _print_interleaved(graphed, iters, rounds) -> dict:
    """Time the graphed paths round by round and print each stash path's cost over the
    graphed capacity path: the median of the per-round ratios, with their range."""
    from tqdm.auto import tqdm
    names = list(graphed)
    times = {name: [] for name in names}
    for _ in tqdm(range(rounds), desc="interleaved rounds", leave=False):
        for name in names:
            times[name].append(median_seconds(graphed[name], iters, warmup=1))
    base = names[0]
    print(f"graph-replayed, {rounds} interleaved rounds of {iters} calls per path:")
    costs = {}
    for name in names[1:]:
        ratios = sorted(t / b for t, b in zip(times[name], times[base]))
        costs[name] = statistics.median(ratios) - 1
        print(f"  {name} over {base}: {costs[name]:+.1%} (median; rounds "
              f"{ratios[0] - 1:+.1%} .. {ratios[-1] - 1:+.1%}; "
              f"{statistics.median(times[name]) * 1e3:.2f} / "
              f"{statistics.median(times[base]) * 1e3:.2f} ms)")
    return costs


def _measure_path(name, loss_fn, params, batch, cfg, iters, profile):
    """``((name, seconds, peak, held, note), run)`` of one path (exact when ``cfg`` is None;
    graphed when ``name`` says so); ``run`` does one more step."""
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    run, box = path_runner(loss_fn, params, batch, cfg, graph="graph" in name,
                           compiled="compiled" in name)
    first = time.perf_counter()
    run()
    torch.cuda.synchronize()
    first = time.perf_counter() - first
    run()
    torch.cuda.empty_cache()        # what stays reserved: the graph's pool, not the cache
    reserved = torch.cuda.memory_reserved() - reserved
    peak = peak_bytes(run) + torch.cuda.memory_allocated() - base
    if box:
        box["reruns"] = 0
    seconds = median_seconds(run, iters, warmup=0)
    if profile:
        print_profile(name, run)
    note = f"{box['reruns']}/{iters} reran {sorted(box['reasons'])}" if box else "-"
    if "graph" in name:     # what the graph's private pool pins while the graph lives
        note += f"; reserves {reserved / 2**20:.0f} MiB"
    if "compiled" in name:
        note += f"; first call (compiles) {first:.1f} s"
    held = held_after_forward(loss_fn, params, batch, cfg, step=box and box["step"])
    return (name, seconds, peak, held, note), run


def _stash_configs(pool_scopes, **factors) -> dict:
    """``{scope: StashConfig}`` of the capacity+stash paths, one per pool scope (a string is
    one scope); a bad factor or scope raises here, before anything is timed."""
    return {scope: psf.StashConfig(paged_stash=True, pool_scope=scope, **factors)
            for scope in pool_scopes_of(pool_scopes)}


def _print_rows(rows, flops, grad_bytes):
    t0, m0, h0 = rows[0][1], rows[0][2], rows[0][3]
    print("peak: most memory a step adds; held: what stays between forward and backward; "
          "floor: gradient bytes + held")
    print(f"{'path':<16} {'ms':>8} {'TFLOP/s':>8} {'x exact':>8} {'peak MiB':>9} "
          f"{'x exact':>8} {'held MiB':>9} {'x exact':>8} {'floor MiB':>9} {'peak/floor':>10}"
          f"  reruns")
    for name, t, peak, held, note in rows:
        floor = grad_bytes + held
        print(f"{name:<16} {t * 1e3:>8.2f} {flops / t / 1e12:>8.0f} {t / t0:>8.2f} "
              f"{peak / 2**20:>9.0f} {peak / m0:>8.2f} {held / 2**20:>9.0f} {held / h0:>8.2f}"
              f" {floor / 2**20:>9.0f} {peak / floor:>10.2f}  {note}")
