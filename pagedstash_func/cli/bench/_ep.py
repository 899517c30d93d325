"""`bench ep` (under torchrun): one expert-parallel MoE layer, forward+backward, per rank.

Paths, in one process per rank: the exact path (counts read on the host, exact buffers), and
the capacity path with and without the paged stash at each capacity factor and over each
transport that runs here (NVSHMEM, fixed slots), through `stash_aware` + `run_step`. Per path:
median step time, peak and held memory (held: what stays allocated between forward and
backward, pools included), reruns; every figure is the largest over the ranks. Then the
transports alone, on one layer's rows under balanced routing: fixed slots (``budget`` rows per
peer), NVSHMEM's variable-split exchange of the data rows (with the barrier that follows it),
and NCCL's equal-split all-to-all of the same data rows.
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

import pagedstash_func as psf

from ._common import DTYPES, event_seconds, held_after_forward, path_runner, pool_scopes_of


def bench_ep(tokens=8192, hidden=2048, ffn=1408, experts=64, top_k=6, factors=(1.25, 1.5),
             iters=10, device=None, dtype_name="bf16", cuda_factor=1.10, seed=0,
             transports=(), pool_scopes=("state",), dp=1):
    """Print (rank 0) and return rows ``(path, s, peak, held, workspace bytes, reruns)``.

    ``pool_scopes``: one capacity+stash path per `StashConfig.pool_scope` at each factor and
    transport (``"layer"``: the pools come and go with the layer, so peak counts them only
    while they live)."""
    scopes = pool_scopes_of(pool_scopes)
    world, device = _start(device, dp)
    group, mesh, ranks = _mesh_of(world, device, dp)
    ep = mesh.get_group("ep") if mesh is not None else world
    rank = dist.get_rank()
    dtype = DTYPES[dtype_name] if device.type == "cuda" else torch.float32
    full = psf.moe_init(experts, hidden, ffn, generator=torch.Generator().manual_seed(seed),
                        dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed + 1 + rank)
    params = {"moe": psf.shard_experts(full, group),
              "x": torch.randn(tokens, hidden, generator=gen).to(device, dtype)}
    del full
    batch = {"c": torch.randn(tokens, hidden, generator=gen).to(device, dtype)}

    def loss_fn(p, b):
        y = psf.moe(p["moe"], p["x"], top_k=top_k, group=group)
        return (y.float() * b["c"].float()).sum()

    paths = _paths(loss_fn, params, batch, ep, device, factors, transports, scopes,
                   cuda_factor)
    rows = []
    for name, cfg, graph in paths:
        if rank == 0:
            print(f"timing {name} ...", flush=True)
        rows.append(_measure(name, loss_fn, params, batch, cfg, iters, device, graph, mesh))
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        layout = f"dp {dp} x ep {ranks}" if mesh is not None else f"{ranks} ranks"
        print(f"{layout} of {name}; per rank T={tokens} H={hidden} F={ffn} E={experts} "
              f"(E/R={experts // ranks}) k={top_k} {dtype}; figures are the largest over the "
              f"ranks{'; a step includes psf.reduce_gradients over the mesh' if mesh else ''}",
              flush=True)
        _print(rows, device.type == "cuda")
    _bench_transport(tokens, hidden, top_k, factors[-1], dtype, device, ep, iters)
    dist.destroy_process_group()
    return rows


SCOPE_LABELS = {"state": "capacity+stash", "layer": "stash/layer pools"}


def _mesh_of(world, device, dp):
    """``(group, mesh, ep ranks)``: the world, or with ``dp > 1`` a ``("dp", "ep")`` mesh
    (experts over ep, gradients over both)."""
    ranks = dist.get_world_size()
    if dp <= 1:
        return world, None, ranks
    if ranks % dp or ranks // dp < 2:
        raise ValueError(f"--dp {dp} needs a multiple of it, with at least 2 ranks a dp "
                         f"replica, got {ranks} ranks: torchrun --nproc_per_node "
                         f"{2 * dp} ... --dp {dp}")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (dp, ranks // dp), mesh_dim_names=("dp", "ep"))
    return mesh, mesh, ranks // dp


def _paths(loss_fn, params, batch, ep, device, factors, transports, scopes, cuda_factor):
    """``[(name, StashConfig or None, graphed)]``: the exact path, then per transport,
    factor and path (capacity, a stash per pool scope), eager and (on CUDA) graphed."""
    paths = [("exact", None, False)]
    graphs = (False, True) if device.type == "cuda" else (False,)
    runs_here = psf.available_transports(ep)
    if "nvshmem" in transports and "nvshmem" not in runs_here:
        raise ValueError("--transports nvshmem: NVSHMEM does not run here (it needs NCCL, "
                         "NVSHMEM and a power-of-two group); pass --transports fixed")
    for transport in transports or runs_here:
        # the largest workspace first, so that it never grows (and retires buffers) later
        psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=max(factors),
                                                 transport=transport)).init(params, batch)
        for cf in factors:
            for label, stash, scope in [("capacity", False, "state")] + [
                    (SCOPE_LABELS[s], True, s) for s in scopes]:
                cfg = psf.StashConfig(capacity_factor=cf, paged_stash=stash,
                                      cuda_factor=cuda_factor, transport=transport,
                                      pool_scope=scope)
                for graph in graphs:
                    paths.append((f"{transport}{' graphed' if graph else ''} {label} cf {cf}",
                                  cfg, graph))
    return paths


def _start(device, dp=1):
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) < 2:
            dp_flag, each = (f" --dp {dp}", " a dp replica") if dp > 1 else ("", "")
            raise ValueError(f"bench ep runs under torchrun with 2 or more ranks{each}: "
                             f"torchrun --nproc_per_node {2 * dp} -m pagedstash_func bench ep"
                             f"{dp_flag} (on a machine without GPUs add --device cpu and small "
                             f"--tokens/--hidden)")
        if device is None and not torch.cuda.is_available():
            raise ValueError("bench ep times NCCL exchanges and needs GPUs; this machine has "
                             "none (pass --device cpu, with small --tokens/--hidden, to try it "
                             "on gloo)")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: this machine has no CUDA device")
        device = torch.device(device or "cuda")
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.group.WORLD, torch.device(device)


def _measure(name, loss_fn, params, batch, cfg, iters, device, graph=False, mesh=None):
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated() if cuda else 0
    run, box = path_runner(loss_fn, params, batch, cfg, graph)
    if mesh is not None:
        step = run

        def run():
            return psf.reduce_gradients(step(), mesh)
    run(), run()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        dist.barrier()
        times.append(event_seconds(run) if cuda else _wall(run))
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    held = held_after_forward(loss_fn, params, batch, cfg, backward=True) if cuda else 0
    # the NVSHMEM buffers live outside torch's allocator: peak counts them in
    workspace = psf.workspace_bytes() if cfg is not None and cfg.transport == "nvshmem" else 0
    figures = torch.tensor([statistics.median(times), peak + workspace, held, workspace,
                            box["reruns"] if box else 0], dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    del run, box
    return (name, *figures.tolist())


def _wall(fn):
    import time
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _print(rows, memory: bool):
    t0, p0, h0 = rows[0][1], rows[0][2] or 1, rows[0][3] or 1
    if memory:
        print("peak counts the NVSHMEM workspace in; held is what the layer keeps for backward "
              "(activations, pages); the workspace is fixed per process")
    else:
        print("memory is measured on CUDA only: its columns read 0 here")
    print(f"{'path':<46} {'ms':>7} {'x exact':>8} {'peak MiB':>9} {'x exact':>8} "
          f"{'held MiB':>9} {'x exact':>8} {'workspace':>9} {'reruns':>6}")
    for name, t, peak, held, workspace, reruns in rows:
        print(f"{name:<46} {t * 1e3:>7.2f} {t / t0:>8.2f} {peak / 2**20:>9.0f} "
              f"{peak / p0:>8.2f} {held / 2**20:>9.0f} {held / h0:>8.2f} "
              f"{workspace / 2**20:>9.0f} {reruns:>6.0f}", flush=True)


def _bench_transport(tokens, hidden, top_k, cf, dtype, device, group, iters):
    """One layer's rows, balanced: fixed slots, NVSHMEM variable splits, NCCL equal split."""
    if device.type != "cuda":
        return
    ranks = dist.get_world_size()
    budget = psf.capacity_rows(tokens, top_k, psf.StashConfig(capacity_factor=cf), ranks).budget
    payload = tokens * top_k // ranks                   # rows a rank sends each peer, evenly
    slots = torch.randn(ranks * budget, hidden, device=device).to(dtype)
    even = slots[:ranks * payload].clone()
    out_fixed, out_even = torch.empty_like(slots), torch.empty_like(even)
    runs = {"fixed slots (budget rows per peer)":
            lambda: dist.all_to_all_single(out_fixed, slots, group=group)}
    if "nvshmem" in psf.available_transports(group):
        runs["NVSHMEM vdev + barrier (data rows)"] = _vdev_run(even, payload, budget, group)
    runs["NCCL equal split (data rows only)"] = \
        lambda: dist.all_to_all_single(out_even, even, group=group)
    results = {}
    for name, fn in runs.items():
        fn(), fn()
        torch.cuda.synchronize()
        results[name] = statistics.median(event_seconds(fn) for _ in range(iters))
    data = ranks * payload * hidden * slots.element_size()
    if dist.get_rank() == 0:
        print(f"all-to-all, one layer's rows (cf {cf}; {data / 2**20:.0f} MiB of data rows "
              f"per rank):")
        for name, t in results.items():
            print(f"  {name:<36} {t * 1e3:>7.3f} ms  {data / t / 1e9:>7.1f} GB/s of data rows")


def _vdev_run(rows, payload, budget, group):
    """``torch.ops.symm_mem.all_to_all_vdev`` as the NVSHMEM transport runs it: symmetric
    buffers, splits on the device, then a one-element all-reduce as the barrier."""
    import torch.distributed._symmetric_memory as symm_mem
    ranks, name = dist.get_world_size(group), group.group_name
    if symm_mem.get_backend(rows.device) != "NVSHMEM":
        symm_mem.set_backend("NVSHMEM")
    size = max(rows.shape[0], budget)

    def symmetric(*shape, dtype):
        t = symm_mem.empty(*shape, dtype=dtype, device=rows.device)
        symm_mem.rendezvous(t, name)
        return t
    send, recv = (symmetric(size, rows.shape[1], dtype=rows.dtype) for _ in range(2))
    send[:rows.shape[0]].copy_(rows)
    splits = symmetric(ranks, dtype=torch.int64)
    splits.fill_(payload)
    out_splits = symmetric(2, ranks, dtype=torch.int64)
    token = torch.zeros(1, device=rows.device)

    def run():
        torch.ops.symm_mem.all_to_all_vdev(send, recv, splits, out_splits, name)
        dist.all_reduce(token, group=group)
    return run
