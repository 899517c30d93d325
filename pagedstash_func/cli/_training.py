"""`train`: a transformers MoE model trained for some steps on a ``("dp", "ep")`` mesh.

Each rank builds only its own experts (`psf.from_hf_config`, transformers' random init,
seeded: the same model on any mesh), holds its fp32 master weights and AdamW moments sharded
over the ranks that replicate each tensor (`psf.sharded_optimizer`, ZeRO-1) and steps one
path (`run_step`, `psf.graphed` or a `psf.compile` step) on a batch of its own, the same every
step (seeded by the global rank: the loss falls as the model learns it). Printed as it runs:
the loss (the mean over the ranks), the step time and reruns; then, per path, the slowest
rank's median step time, tokens/s per GPU, MFU and the largest peak and held memory over the
ranks beside `psf.plan_memory`'s peak. ``--save`` writes a DCP checkpoint (weights,
optimizer state, step count) that ``--resume`` reads on any mesh whose ``ep`` divides the
experts. On CPU ranks (gloo) it runs as a rehearsal: times mean little and memory is not
measured.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

import pagedstash_func as psf

from .bench._train import (
    PEAK_FLOPS,
    hf_config,
    make_batch,
    path_config,
    path_stepper,
    shape_of,
)
from .bench._common import largest_fitting
from .bench._train_mesh import over_ranks

TRAIN_PATHS = ("exact", "capacity", "stash-layer", "graphed", "compiled", "compiled-graphed")
PLANNED = ("qwen3_moe", "olmoe", "mixtral")          # the families psf.plan_memory takes
FILL = 0.95      # --tokens auto: the most tokens whose planned peak is within this share


def train(model="qwen3_moe", *, ep=None, dp=None, layers=None, tokens=None, seq=None,
          paths=("stash-layer",), steps=20, capacity_factor=1.25, lr=1e-4, max_norm=1.0,
          save=None, resume=None, device=None, seed=0, shape_overrides=None) -> dict:
    """Train ``model`` for ``steps`` on each of ``paths`` in turn, each from the same start
    (the seed's weights, or ``resume``'s checkpoint), and print a row per path.

    Args:
        model: a family of bench train's shapes (``qwen3_moe``, ``olmoe``, ...).
        ep, dp: the mesh over torchrun's ranks (one given: the other is the world over it;
            neither, without torchrun: one process).
        layers, seq, shape_overrides: the shape, as bench train takes them.
        tokens: a rank's tokens a step, or ``"auto"`` (CUDA): the most whole sequences whose
            `psf.plan_memory` peak stays within 95 % of the device on every path.
        paths: psf paths (`TRAIN_PATHS`).
        steps, capacity_factor, lr, max_norm, seed: the run (AdamW, weight decay 0.01,
            clipped to ``max_norm``).
        save, resume: a checkpoint path to write after the steps, or to start from (one
            path); resumed on any mesh whose ``ep`` divides the experts.
        device: ``"cuda"`` or ``"cpu"`` (gloo ranks: a rehearsal, no memory figures).

    Returns:
        ``{path: row}``: ``row["losses"]`` each step's loss (the mean over the ranks),
        ``"s"`` the slowest rank's median step seconds, ``"peak"``/``"held"`` the largest
        over the ranks (bytes; 0 on the CPU), ``"plan"`` the plan's peak (None where it has
        none), ``"reruns"``.

    Raises:
        ValueError: bad arguments, named with their fix (on every rank, before any
            collective). A rank that fails mid-run ends the run under torchrun; inside a
            process group of the caller's, the others wait for the group's timeout.
    """
    _check_args(paths, steps, lr, save, resume, device)
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise ValueError("train builds transformers models: pip install -e '.[interop]'") \
            from err
    auto = tokens == "auto"
    shape = shape_of(model, layers=layers, tokens=None if auto else tokens, seq=seq,
                     **(shape_overrides or {}))
    mesh, device, ep, dp = _begin(ep, dp, device)
    if shape.experts % ep:
        raise ValueError(f"--ep {ep} does not divide the {shape.experts} experts of "
                         f"--model {model}")
    config = hf_config(shape)
    if auto:
        shape = _most_tokens(shape, config, mesh, paths, capacity_factor, max_norm, device)
    rank = dist.get_rank() if mesh is not None else 0
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"train --model {shape.model}: {shape.layers} layers, H {shape.hidden}, "
        f"{shape.experts} experts x {shape.ffn} ({shape.experts // ep} a rank), top-"
        f"{shape.top_k}, T={shape.tokens} a rank ({shape.batch} x {shape.seq}), bf16, cf "
        f"{capacity_factor}, AdamW lr {lr} (ZeRO-1) clipped at {max_norm}; dp {dp} x ep {ep} "
        f"on {device.type}; torch {torch.__version__}", flush=True)
    rows = {}
    for path in paths:
        rows[path] = _run_path(path, shape, config, mesh, device, rank, say, steps=steps,
                               cf=capacity_factor, lr=lr, max_norm=max_norm, save=save,
                               resume=resume, seed=seed)
    _table(shape, rows, say)
    if mesh is not None:
        dist.barrier()
    return rows


def _check_args(paths, steps, lr, save, resume, device) -> None:
    unknown = [p for p in paths if p not in TRAIN_PATHS]
    if unknown or not paths:
        raise ValueError(f"--paths {','.join(paths)}: choose from {', '.join(TRAIN_PATHS)}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--steps must be a positive number of steps, got {steps!r}")
    if (save or resume) and len(paths) != 1:
        raise ValueError("--save and --resume take one path: give --paths one name")
    cuda = torch.device(device or "cuda").type == "cuda"
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"--lr must be a finite learning rate > 0, got {lr!r}")
    if save and os.path.lexists(save) and not os.path.islink(save):
        raise ValueError(f"--save {save} exists and is not a checkpoint --save wrote: give a "
                         f"new path (checked before training, not after it)")
    if resume and not os.path.isdir(resume):
        raise ValueError(f"--resume {resume} is not a checkpoint: give the path --save wrote")
    graphed = [p for p in paths if p.endswith("graphed")]
    if not cuda and graphed:
        raise ValueError(f"--paths {','.join(graphed)} replays CUDA graphs: drop it with "
                         f"--device cpu")


def _begin(ep, dp, device):
    """``(mesh, device, ep, dp)``: torchrun's ranks as a ``("dp", "ep")`` mesh, or ``None``
    (and 1, 1) for one process started without torchrun."""
    from .bench._train_mesh import mesh_sizes, start_mesh, world_size
    if not world_size() and (ep or 1) * (dp or 1) == 1:
        device = torch.device(device or "cuda")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("train on CUDA needs a GPU; --device cpu rehearses it on the CPU")
        return None, device, 1, 1
    ep, dp = mesh_sizes(ep, dp, "train")
    return (*start_mesh(ep, dp, device, "train"), ep, dp)


def _most_tokens(shape, config, mesh, paths, cf, max_norm, device):
    """``shape`` with the most whole sequences a rank whose planned peak fits ``FILL`` of the
    device on every one of ``paths`` (`psf.plan_memory`; what it leaves out: the CUDA
    context, NCCL's buffers, the NVSHMEM workspace, a CUDA graph's pool, fragmentation)."""
    import dataclasses
    if device.type != "cuda":
        raise ValueError("--tokens auto sizes the step to the GPU's memory: give --tokens on "
                         "the CPU")
    if shape.model not in PLANNED:
        raise ValueError(f"--tokens auto plans with psf.plan_memory, which takes "
                         f"{', '.join(PLANNED)}; give --tokens for {shape.model}")
    room = FILL * torch.cuda.get_device_properties(device).total_memory

    def largest(tokens):
        return max((_plan(config, tokens, mesh, p, cf, max_norm) for p in paths),
                   key=lambda plan: plan.peak)

    def fits(seqs: int) -> bool:
        return largest(seqs * shape.seq).peak <= room
    most = largest_fitting(fits)
    if not most:
        raise ValueError(f"one sequence of {shape.seq} tokens does not fit 95 % of the GPU by "
                         f"the plan: {largest(shape.seq).table()}")
    return dataclasses.replace(shape, tokens=most * shape.seq)


def _plan(config, tokens, mesh, path, cf, max_norm):
    return psf.plan_memory(config, tokens, mesh=mesh, optimizer="adamw", max_norm=max_norm,
                           cfg=path_config(path, cf), dtype=torch.bfloat16)


def _run_path(path, shape, config, mesh, device, rank, say, *, steps, cf, lr, max_norm,
              save, resume, seed) -> dict:
    """Build, (resume,) train ``steps`` on ``path``, (save,) measure; everything freed after."""
    say(f"  {path}:", flush=True)
    torch.manual_seed(seed)
    params, loss_fn = psf.from_hf_config(config, group=mesh, init=resume is None,
                                         dtype=torch.bfloat16, device=device)
    cuda = device.type == "cuda"
    opt = psf.sharded_optimizer(params, mesh, torch.optim.AdamW, lr=lr, weight_decay=0.01,
                                max_norm=max_norm, **({"fused": True} if cuda else {}))
    first = _resume(resume, params, opt, mesh) if resume else 0
    if resume:
        say(f"    resumed from {os.path.abspath(resume)} at step {first}", flush=True)
    batch = make_batch(shape, device, seed + 1 + rank)
    stepper, box = path_stepper(path, params, loss_fn, batch, cf)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, times, reruns = [], [], 0
    for i in range(first, first + steps):
        began = time.perf_counter()
        res = stepper(params, batch, box["state"])
        box["state"] = res.state
        opt.step(params, res.grads)
        loss = _mean_loss(res.loss, mesh)        # a collective: every rank has finished
        times.append(time.perf_counter() - began)
        reruns += int(res.report.reran)
        losses.append(loss)
        say(f"    step {i + 1:>4}  loss {loss:.4f}  {times[-1] * 1e3:9.1f} ms"
            f"{'  (reran)' if res.report.reran else ''}", flush=True)
        del res
    row = _figures(shape, config, mesh, path, cf, max_norm, times, reruns, losses, cuda)
    if save:
        _save(save, params, opt, mesh, first + steps)
        say(f"    saved at step {first + steps}: {os.path.abspath(save)}", flush=True)
    del params, loss_fn, opt, stepper, box, batch
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def _mean_loss(loss, mesh) -> float:
    loss = loss.detach().float().reshape(1).clone()
    if mesh is not None:
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    return float(loss)


def _figures(shape, config, mesh, path, cf, max_norm, times, reruns, losses, cuda) -> dict:
    """The slowest rank's median step (past the first two, which compile and warm up; all of
    them in a run of two steps or fewer) and the largest peak and held bytes over the ranks
    (torch's allocator, and with the NVSHMEM workspace outside it), beside the plan's peak."""
    timed = times[2:] or times
    allocated = peak = held = 0
    if cuda:
        workspace = psf.workspace_bytes()          # NVSHMEM: outside torch's allocator
        allocated = torch.cuda.max_memory_allocated()
        peak, held = allocated + workspace, torch.cuda.memory_allocated() + workspace
    values = [statistics.median(timed), peak, held, allocated]
    if mesh is not None:
        values = over_ranks(values, max)
    plan = _plan(config, shape.tokens, mesh, path, cf, max_norm).peak \
        if shape.model in PLANNED else None
    return {"s": values[0], "peak": values[1], "held": values[2], "allocated": values[3],
            "plan": plan, "reruns": reruns, "steps": len(times), "losses": losses}


def _save(path, params, opt, mesh, step: int) -> None:
    tree = {"params": params, "opt": opt.state_tree(), "step": torch.tensor(step)}
    psf.save_checkpoint(path, tree, mesh)


def _resume(path, params, opt, mesh) -> int:
    """Load ``path`` into ``opt`` and ``params`` (the optimizer writes its master weights
    into them); the step it was saved at."""
    like = {"params": params, "opt": opt.state_tree(), "step": torch.tensor(0)}
    back = psf.load_checkpoint(path, like, mesh)
    opt.load_state_tree(back["opt"])
    return int(back["step"])


def _table(shape, rows, say) -> None:
    ref = next(iter(rows.values()))
    say(f"\n{'path':<17}{'ms':>9}{'tok/s/GPU':>11}{'x first':>8}{'MFU':>7}{'peak MiB':>10}"
        f"{'plan MiB':>10}{'x plan':>8}{'held MiB':>10}{'reruns':>8}{'loss':>18}")
    for path, r in rows.items():
        tps = shape.tokens / r["s"]
        measured = r["peak"] > 0                    # on CUDA
        mfu = f"{tps * shape.flops_per_token() / PEAK_FLOPS:.1%}" if measured else "-"
        plan = f"{r['plan'] / 2**20:.0f}" if r["plan"] else "-"
        ratio = f"{r['allocated'] / r['plan']:.3f}" if r["plan"] and measured else "-"
        peak, held = (f"{r[k] / 2**20:.0f}" if measured else "-" for k in ("peak", "held"))
        loss = f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}"
        say(f"{path:<17}{r['s'] * 1e3:>9.1f}{tps:>11.0f}{r['s'] / ref['s']:>8.2f}{mfu:>7}"
            f"{peak:>10}{plan:>10}{ratio:>8}{held:>10}"
            f"{str(r['reruns']) + '/' + str(r['steps']):>8}{loss:>18}")
    say("(ms: the slowest rank's median step past the first two (every step in a run of two "
        "or fewer), x first: over the first path's; memory the largest over the "
        "ranks, absolute: weights, optimizer state and pools, the NVSHMEM workspace counted "
        "in peak and held; plan: psf.plan_memory's peak for the step, x plan torch's "
        "allocated peak over it (the workspace, the CUDA context and NCCL's buffers are not "
        "planned); MFU over 989 TFLOP/s; on CPU ranks neither memory nor MFU is measured)",
        flush=True)
