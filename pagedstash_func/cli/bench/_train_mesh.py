"""`bench train --ep N --dp M` (under torchrun, N x M ranks): a whole transformers MoE model
on a ``("dp", "ep")`` mesh, per rank.

transformers' path is the same model data-parallel over every rank (each rank holds the whole
model, runs ``.backward()`` on its own micro-batches, and the gradients are summed over the
world, one all-reduce per dtype). psf's paths hold the model through
``psf.from_hf_model(model, group=mesh)``: each rank keeps its ``E / ep`` experts of every sparse
block, the rest replicated; a step is `run_step` (or `psf.graphed`) and
`psf.reduce_gradients` over the mesh. Every rank runs ``--tokens`` tokens a step (its own
batch, seeded by its rank). Per path: the slowest rank's median step time, tokens/s per GPU,
the largest peak and held memory over the ranks (pools and the NVSHMEM workspace counted),
the rows the expert exchanges moved per rank and step (forward and backward, both ways), and
reruns. On CPU ranks (gloo) it runs as a smoke test: times mean little there and memory is
not measured.
"""

from __future__ import annotations

import copy
import os
import statistics
import time

import torch
import torch.distributed as dist

import pagedstash_func as psf

from ._train import PATHS, adamw, build, make_batch, path_stepper, shape_of

MESH_PATHS = tuple(p for p in PATHS if p not in ("func", "checkpoint", "fp8"))


def world_size() -> int:
    """Ranks of this run: torchrun's ``WORLD_SIZE``, or the group already made (0: neither)."""
    return int(os.environ.get("WORLD_SIZE", "0")) or (
        dist.get_world_size() if dist.is_initialized() else 0)


def mesh_sizes(ep, dp, command: str = "bench train") -> tuple[int, int]:
    """``(ep, dp)`` from the flags given (``None``: not given) and the world size: one given,
    the other is the world over it (as `demo` takes them). ``command`` names the command in
    the errors."""
    world = world_size()
    if not world:
        raise ValueError(f"{command} --ep/--dp runs under torchrun: torchrun --nproc_per_node "
                         f"{(ep or 1) * (dp or 1)} -m pagedstash_func {command} --ep "
                         f"{ep or 1} --dp {dp or 1} ...")
    if ep is None and dp is None:              # every rank an expert rank
        ep = world
    if ep is None and world % dp == 0:
        ep = world // dp
    if dp is None and world % ep == 0:
        dp = world // ep
    return ep or 1, dp or 1


def start_mesh(ep: int, dp: int, device, command: str = "bench train"):
    """The process group (torchrun's, or one already made) and the ``("dp", "ep")`` mesh."""
    world = world_size() or 1
    if world != ep * dp:
        raise ValueError(f"--ep {ep} --dp {dp} needs {ep * dp} ranks, this run has {world}: "
                         f"torchrun --nproc_per_node {ep * dp} -m pagedstash_func {command} "
                         f"--ep {ep} --dp {dp} ...")
    device = torch.device(device or "cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{command} --ep/--dp on CUDA needs GPUs; --device cpu runs it "
                             "on gloo as a smoke test")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (dp, ep), mesh_dim_names=("dp", "ep"))
    return mesh, device


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


OPTIMIZERS = ("adamw", "adamw-sharded")


def _optimizer(kind, weights, group):
    """``None``, AdamW with its whole fp32 state on every rank (``"adamw"``: the gradients
    reduced first), or sharded over the ranks that replicate each tensor (``"adamw-sharded"``:
    it reduces them itself)."""
    if kind is None:
        return None
    return adamw(weights, group if kind == "adamw-sharded" else None)


def _hf_runner(model, batch, optimizer=None):
    weights = list(model.parameters())
    opt = _optimizer(optimizer, weights, dist.group.WORLD)   # every tensor replicated

    def run():
        loss = model(**batch).loss
        loss.backward()
        grads = [p.grad for p in weights]
        if optimizer != "adamw-sharded":
            psf.all_reduce_replicated(grads)      # data parallelism: summed over every rank
        if opt is not None:
            opt.step(weights, grads)
        for p in weights:
            p.grad = None
        return loss.detach(), 0, None
    run.opt = opt
    return run


def _psf_runner(path, params, loss_fn, batch, cf, mesh, optimizer=None):
    stepper, box = path_stepper(path, params, loss_fn, batch, cf)
    opt = _optimizer(optimizer, params, mesh)

    def run():
        res = stepper(params, batch, box["state"])
        box["state"] = res.state
        if optimizer != "adamw-sharded":
            psf.reduce_gradients(res.grads, mesh)
        if opt is not None:
            opt.step(params, res.grads)
        # the exact path counts no loads on the device: no figure for it
        ep_layers = [layer for layer in res.report.layers if layer.group_size > 1]
        rows = sum(sum(layer.rank_load) for layer in ep_layers) \
            if ep_layers and path != "exact" else None
        return res.loss, int(res.report.reran), rows
    run.opt = opt
    return run, box


def _measure(run, iters, warmup, device) -> dict:
    reruns = 0
    rows = None
    for _ in range(warmup):
        _, rr, _ = run()
        reruns += rr
    times = []
    for _ in range(iters):
        _sync(device)
        began = time.perf_counter()
        loss, rr, moved = run()
        _sync(device)
        times.append(time.perf_counter() - began)
        reruns, rows = reruns + rr, moved
    return {"s": statistics.median(times), "reruns": reruns, "loss": float(loss),
            "steps": warmup + iters, "rows": rows}


def over_ranks(values, op):
    """``op`` (max, or a mean) of each of ``values`` over every rank."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [float(v) for v in values])
    return [op(col) for col in zip(*every)]


def bench_train_mesh(model="qwen3_moe", ep=2, dp=1, layers=None, tokens=None, seq=None,
                     paths=("transformers", "exact", "capacity", "stash-layer"),
                     capacity_factor=1.25, iters=5, warmup=2, device=None, seed=0,
                     loss_chunk=0, shape_overrides=None, optimizer=None) -> dict:
    """Print (rank 0) and return one row per path; see the module docstring."""
    unknown = [p for p in paths if p not in MESH_PATHS]
    if unknown or not paths:
        raise ValueError(f"--paths {','.join(paths)} with --ep/--dp: choose from "
                         f"{', '.join(MESH_PATHS)}")
    if optimizer not in (None, *OPTIMIZERS):
        raise ValueError(f"--optimizer {optimizer!r} with --ep/--dp: choose from "
                         f"{', '.join(OPTIMIZERS)}")
    if "graphed" in paths and torch.device(device or "cuda").type != "cuda":
        raise ValueError("--paths graphed replays CUDA graphs: drop it with --device cpu")
    shape = shape_of(model, layers=layers, tokens=tokens, seq=seq, **(shape_overrides or {}))
    if shape.experts % ep:
        raise ValueError(f"--ep {ep} does not divide the {shape.experts} experts of "
                         f"--model {model}")
    mesh, device = start_mesh(ep, dp, device)
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"bench train --model {shape.model} --ep {ep} --dp {dp}: {shape.layers} layers, H "
        f"{shape.hidden}, {shape.experts} experts x {shape.ffn} ({shape.experts // ep} a rank), "
        f"top-{shape.top_k}, T={shape.tokens} a rank ({shape.batch} x {shape.seq}), bf16, cf "
        f"{capacity_factor}; {ep * dp} ranks on {device.type}; torch {torch.__version__}",
        flush=True)
    model_hf = build(shape, device, seed)              # the same weights on every rank
    batch = make_batch(shape, device, seed + 1 + rank)
    own = copy.deepcopy(model_hf) if "transformers" in paths else model_hf
    params, loss_fn = psf.from_hf_model(own, group=mesh,
                                        loss_chunk=None if loss_chunk < 0 else loss_chunk)
    rows = {}
    for path in paths:
        say(f"  {path} ...", flush=True)
        rows[path] = _path_row(path, model_hf, params, loss_fn, batch, capacity_factor, mesh,
                               optimizer, iters, warmup, device)
    _table(shape, rows, say, ep)
    dist.barrier()
    return rows


def _path_row(path, model_hf, params, loss_fn, batch, cf, mesh, optimizer, iters, warmup,
              device) -> dict:
    """One path's figures, each the largest over the ranks (the loss their mean)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    if path == "transformers":
        run, box = _hf_runner(model_hf, batch, optimizer), None
    else:
        run, box = _psf_runner(path, params, loss_fn, batch, cf, mesh, optimizer)
    out = _measure(run, iters, warmup, device)
    state = run.opt.state_bytes() if run.opt is not None else 0
    # the NVSHMEM workspace lives outside torch's allocator: counted in as bench ep does
    workspace = psf.workspace_bytes() if cuda and path != "transformers" else 0
    peak = torch.cuda.max_memory_allocated() - base + workspace if cuda else 0
    held = torch.cuda.memory_allocated() - base + workspace if cuda else 0
    del run, box
    s, peak, held, reruns, moved, state = over_ranks(
        [out["s"], peak, held, out["reruns"], -1 if out["rows"] is None else out["rows"],
         state], max)
    loss, = over_ranks([out["loss"]], statistics.mean)
    return {"s": s, "peak": peak, "held": held, "reruns": int(reruns),
            "steps": out["steps"], "rows": None if moved < 0 else moved,
            "loss": loss, "state": state}


def _table(shape, rows, say, ep) -> None:
    ref = rows.get("transformers")
    say(f"\n{'path':<14}{'ms':>9}{'tok/s/GPU':>11}{'x hf':>7}{'peak MiB':>10}{'x hf':>7}"
        f"{'held MiB':>10}{'moved MiB':>11}{'reruns':>8}{'loss - hf':>11}{'opt MiB':>9}")
    for path, r in rows.items():
        tps = shape.tokens / r["s"]
        speed = f"{ref['s'] / r['s']:.2f}" if ref else "-"
        mem = f"{r['peak'] / ref['peak']:.2f}" if ref and ref["peak"] else "-"
        dloss = f"{r['loss'] - ref['loss']:+.2e}" if ref else "-"
        # the pairs routed in an ep group (summed over its ranks), a rank's share of them,
        # (ep - 1) / ep of those leaving it, each a row of H bf16 values sent out and back in
        # forward and again in backward
        moved = "-" if r["rows"] is None else \
            f"{4 * r['rows'] / ep * (ep - 1) / ep * shape.hidden * 2 / 2**20:.2f}"
        say(f"{path:<14}{r['s'] * 1e3:>9.1f}{tps:>11.0f}{speed:>7}{r['peak'] / 2**20:>10.0f}"
            f"{mem:>7}{r['held'] / 2**20:>10.0f}{moved:>11}"
            f"{str(r['reruns']) + '/' + str(r['steps']):>8}{dloss:>11}"
            f"{r['state'] / 2**20:>9.1f}")
    say("(the slowest rank's median; memory the largest over the ranks, opt MiB the "
        "optimizer's fp32 master weights and state on the rank holding most; moved: an estimate "
        "of the MiB of expert rows that crossed ranks per rank and step, from the routed pairs "
        "in the step's report, '-' for a path without one: transformers' or the exact path)",
        flush=True)
