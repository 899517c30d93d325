"""`bench adaptive`: a training run with `psf.adaptive` beside the same run at each fixed rung
of its ladder, per seed: reruns, mean step time (reruns included) and, on CUDA, peak memory.

The model is the demo's (``--model demo``) or a tiny transformers model through
`psf.from_hf_model` (``--model qwen3_moe|olmoe|mixtral|qwen2_moe|deepseek_v3``), trained
from its seeded init on the demo's text, so its routing drifts as it learns. A fixed factor
chosen in hindsight is the rung whose run was fastest for that seed; the adaptive run is
read against it, and against the rung chosen on the other half of the steps
(`held_out_ratio`: the fastest of eleven runs is partly the luckiest, and a rung chosen and
timed on the same steps keeps that luck; the two ratios bracket the ladder's cost).
``--graph`` replays every attempt from CUDA graphs (`psf.graphed`; `psf.adaptive(..., graph=True)`).
Runs on the CPU (fp32) or on CUDA (bf16 experts).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time

import torch
import torch.utils._pytree as pytree

import pagedstash_func as psf

from .. import _demo as demo

MODELS = ("demo",) + demo.HF_MODELS


@dataclasses.dataclass
class RunFigures:
    """One training run: steps that reran (``exact`` of them on the exact path, the rest at
    a rung of the ladder), mean seconds a step after the warm-up (reruns included), on CUDA
    the peak bytes over what was allocated before its state, and the mean budget (rows per
    rank, summed over the layers) of the attempts it ran."""

    reruns: int
    seconds: float
    peak: int | None
    captures: int = 0
    exact: int = 0
    budget: float = 0.0       # mean rows a rank may take a step, summed over the layers
    halves: tuple = ()        # mean seconds over two halves of the steps (`_halves`)


def _trainer(model, seed, vocab, device, dtype, hidden=64, ffn=96):
    """``(params, loss_fn, update)`` of a fresh seeded model: ``update(grads, i)`` takes one
    optimizer step (the demo's pure Adam, or ``torch.optim.AdamW`` on a transformers model,
    whose params alias the model and are updated in place)."""
    if model == "demo":
        params = demo.init_model(vocab, hidden=hidden, ffn=ffn, seed=seed, device=device)
        loss_fn = demo.make_loss_fn(None, dtype)
        box = {"params": params, "moments": (pytree.tree_map(torch.zeros_like, params),) * 2}

        def update(grads, i):
            box["params"], box["moments"] = demo.adam(box["params"], grads, box["moments"],
                                                      i + 1)
            return box["params"]
        return params, loss_fn, update
    hf = demo.hf_model(model, vocab, seq=32, seed=seed, device=device, dtype=dtype,
                       hidden=hidden, ffn=ffn)
    params, loss_fn = psf.from_hf_model(hf)
    leaves = psf.trainable(params)
    opt = torch.optim.AdamW(leaves, lr=3e-3)

    def update(grads, i):
        psf.set_grads(params, grads)
        opt.step()
        for p in leaves:
            p.grad = None
        return params
    return params, loss_fn, update


class _Run:
    """One training run in progress: its runner, its params and optimizer, its tallies."""

    def __init__(self, make_runner, params, update, first_batch):
        self.runner, self.owner = make_runner(params, first_batch)
        self.params, self.update = params, update
        self.reruns, self.seconds, self.budgets, self.steps = 0, [], [], []

    def step(self, i, batch, clock, sync):
        sync()                     # the previous run's optimizer step is not this run's time
        began = clock()
        res = self.runner(self.params, batch)
        sync()
        self.seconds.append(clock() - began)
        self.steps.append(i)
        self.reruns += res.report.reran
        self.budgets.append(sum(layer.budget for layer in res.report.layers))
        self.params = self.update(res.grads, i)


def _train_lockstep(starts, batches, device, warmup, chunk=10) -> list[RunFigures]:
    """The runs of one seed in lockstep, ``chunk`` steps at a time: every run takes steps
    ``i .. i + chunk - 1`` (in an order rotated each chunk) before any takes the next ones, so
    a machine that drifts slower or faster over minutes moves every run alike, while each run
    steps several times in a row as a training loop does (its code and data in the host's
    caches: runs that alternate every step, ``chunk=1``, evict each other's, which costs a
    longer host path more). ``starts``: ``(make_runner, params, update)`` per run.
    Timed on the CPU as the process's CPU time (one thread); on CUDA as wall time, the GPU
    synchronised before and after each step. What the runs built before the first step is
    frozen out of Python's garbage collector (`gc.freeze`), which would otherwise walk it on
    every full collection, in whichever run's step triggered one."""
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    runs = [_Run(make, params, update, batches[0]) for make, params, update in starts]
    # what the runs built (models, graphs, states) out of the collector's way: a full
    # collection walks every object, and would land on whichever run's step triggered it
    gc.collect()
    gc.freeze()
    try:
        for k, first in enumerate(range(0, len(batches), chunk)):
            at = k % len(runs)
            for run in runs[at:] + runs[:at]:
                for i in range(first, min(first + chunk, len(batches))):
                    run.step(i, batches[i], clock, sync)
    finally:
        gc.unfreeze()
    return [RunFigures(r.reruns, statistics.mean(r.seconds[warmup:] or r.seconds), None,
                       getattr(r.owner, "captures", 0), _exact_reruns(r),
                       statistics.mean(r.budgets), _halves(r, warmup, chunk)) for r in runs]


def _halves(run, warmup, chunk) -> tuple:
    """Mean seconds of the timed steps in two halves of the run that every run shares step
    for step: chunks 0, 1, 4, 5, 8, ... and chunks 2, 3, 6, 7, ... (pairs of chunks, so that
    each run takes every place in the lockstep's rotated order in both halves, whatever the
    number of runs); ``()`` where either half has no step."""
    parts = ([], [])
    for i, seconds in zip(run.steps[warmup:], run.seconds[warmup:]):
        parts[(i // chunk // 2) % 2].append(seconds)
    return tuple(statistics.mean(p) for p in parts) if all(parts) else ()


def held_out_ratio(ladder: RunFigures, fixed: list) -> float | None:
    """The ladder's time over the fixed rung chosen on the other half of the steps, averaged
    over the two halves (the rung fastest on one half, timed on the other, and the other way
    round). The fastest of many runs timed on the steps it was picked on keeps the luck of
    that draw, which reads the ladder too slow; a rung picked on half the steps is sometimes
    not the best one, which reads it too fast: the two ratios bracket the ladder's cost.
    ``None`` without halves."""
    if not ladder.halves or not all(f.halves for f in fixed):
        return None
    ratios = []
    for pick_on in (0, 1):
        best = min(fixed, key=lambda f: f.halves[pick_on])
        ratios.append(ladder.halves[1 - pick_on] / best.halves[1 - pick_on])
    return statistics.mean(ratios)


def _exact_reruns(run) -> int:
    """Steps that reran on the exact path: every rerun of a fixed rung, the ladder's moves
    that say so."""
    exact = getattr(run.runner, "exact", None)
    return run.reruns if exact is None else exact()


def _peak(make_runner, params, update, batches, steps=3) -> int:
    """CUDA bytes a run adds at its peak over what was allocated before its step was built
    (its state's pools, graphs and every rung's, counted), over its first ``steps`` steps."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run = _Run(make_runner, params, update, batches[0])
    for i, batch in enumerate(batches[:steps]):
        run.step(i, batch, time.perf_counter, torch.cuda.synchronize)
    peak = torch.cuda.max_memory_allocated() - base
    del run
    return peak


def _fixed(loss_fn, cfg, graph):
    def make(params, batch):
        step = psf.stash_aware(loss_fn, cfg)
        box = {"state": step.init(params, batch)}
        run = psf.graphed(step) if graph else (lambda *a: psf.run_step(step, *a))

        def runner(p, b):
            res = run(p, b, box["state"])
            box["state"] = res.state
            return res
        return runner, run
    return make


def _adaptive(loss_fn, cfg, ladder, graph, max_graphs):
    def make(params, batch):
        astep = psf.adaptive(loss_fn, cfg, ladder, graph=graph, max_graphs=max_graphs)
        # every rung's graph captured before the run, as a fixed rung's is in its warm-up
        box = {"state": astep.warm(params, batch, astep.init(params, batch)), "exact": 0}

        def runner(p, b):              # a state keeps the recent moves only: count as they come
            res, box["state"] = astep(p, b, box["state"])
            box["exact"] += box["state"].moves[-1].rerun == "exact"
            return res
        runner.exact = lambda: box["exact"]
        return runner, astep
    return make


def bench_adaptive(steps=100, seeds=2, rungs=(1.0, 1.1, 1.25, 1.5, 2.0), target=0.02,
                   device="cpu", expert_ranks=2, progress=True, model="demo", graph=False,
                   warmup=2, max_graphs=None, first_seed=0, per_layer=False,
                   chunk=10, batch_size=16, hidden=64, ffn=96) -> dict:
    """Print one row per seed (reruns and ms/step of each fixed rung and of the ladder), then
    the means over the seeds read against the goals: the ladder's rerun rate over the target,
    its time over the best fixed rung's, its peak over the top rung's. ``per_layer`` adds a
    run of the ladder with a rung per layer (``"per layer"``). Returns the figures
    (``{name: [RunFigures per seed]}``). ``chunk``: steps a run takes in a row in the
    lockstep (`_train_lockstep`). ``batch_size`` (windows of 32 characters a step),
    ``hidden`` and ``ffn`` size the model (the defaults: a step bound by launches on a GPU)."""
    from tqdm.auto import tqdm
    device = _checked_device(model, device, graph, max_graphs, hidden, chunk, warmup, steps)
    if device.type == "cpu":      # one thread: two threads on a small machine time noisily
        torch.set_num_threads(1)
    ladder = psf.Ladder(rungs=tuple(rungs), target_rerun_rate=target)
    text = demo.corpus()
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text])
    cfg = psf.StashConfig(capacity_factor=rungs[-1], paged_stash=True, pool_scope="layer",
                          expert_ranks=expert_ranks)
    dtype = torch.bfloat16 if device.type == "cuda" else None
    _print_header(model, hidden, ffn, batch_size, steps, warmup, chunk, first_seed, seeds,
                  expert_ranks, ladder, target, device, graph, max_graphs)
    names = [f"cf {r}" for r in ladder.rungs] + ["adaptive"] + \
        (["per layer"] if per_layer else [])
    layered = dataclasses.replace(ladder, per_layer=True)
    print(f"{'seed':<6}" + "".join(f"{n:>18}" for n in names) + f"{'best fixed':>14}"
          f"{'adaptive / best':>17}{'held out':>10}")
    bar = tqdm(total=seeds * len(names), desc="runs", disable=not progress, leave=False)
    figures: dict[str, list[RunFigures]] = {n: [] for n in names}
    for seed in range(first_seed, first_seed + seeds):
        raw = [demo.make_batch(data, i, batch_size=batch_size, seq=32, seed=seed)
               for i in range(steps)]
        if model != "demo":
            raw = [demo.hf_batch(b) for b in raw]
        batches = [{k: v.to(device) for k, v in b.items()} for b in raw]
        def start(r):
            params, loss_fn, update = _trainer(model, seed, len(vocab), device, dtype, hidden,
                                               ffn)
            if r in ("adaptive", "per layer"):
                make = _adaptive(loss_fn, cfg, ladder if r == "adaptive" else layered, graph,
                                 max_graphs)
            else:
                make = _fixed(loss_fn, dataclasses.replace(cfg, capacity_factor=r), graph)
            return make, params, update
        factors = ladder.rungs + tuple(names[len(ladder.rungs):])
        for name, fig in zip(names, _train_lockstep([start(r) for r in factors], batches,
                                                    device, warmup, chunk)):
            figures[name].append(fig)
        gc.collect()
        if device.type == "cuda":          # memory: one run at a time, a few steps each
            for name, r in zip(names, factors):
                figures[name][-1].peak = _peak(*start(r), batches)
        bar.update(len(names))
        rows = [figures[n][-1] for n in names]
        best = min(rows[:len(ladder.rungs)], key=lambda f: f.seconds)
        cells = "".join(f"{f'{f.reruns} rr, {f.seconds * 1e3:.1f} ms':>18}" for f in rows)
        held = held_out_ratio(rows[len(ladder.rungs)], rows[:len(ladder.rungs)])
        print(f"{seed:<6}{cells}{best.seconds * 1e3:>11.1f} ms"
              f"{rows[len(ladder.rungs)].seconds / best.seconds:>17.3f}"
              f"{'-' if held is None else f'{held:.3f}':>10}", flush=True)
    bar.close()
    _summary(figures, names, steps, target, seeds, len(ladder.rungs))
    return figures


def _checked_device(model, device, graph, max_graphs, hidden, chunk, warmup, steps):
    """The device, once `bench_adaptive`'s arguments are checked (a `ValueError` names the
    flag to change)."""
    if model not in MODELS:
        raise ValueError(f"--model {model!r}: choose one of {', '.join(MODELS)}")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this machine has no CUDA device; use --device cpu")
    if graph and device.type != "cuda":
        raise ValueError("--graph replays CUDA graphs: add --device cuda")
    if max_graphs is not None and not graph:
        raise ValueError("--max-graphs bounds the ladder's CUDA graphs: add --graph, or drop "
                         "--max-graphs")
    heads = 4 if model == "demo" else 8         # transformers' rotary halves need an even head
    if hidden % heads:
        raise ValueError(f"--hidden {hidden} must be a multiple of {heads} for --model {model} "
                         f"(4 attention heads{'' if model == 'demo' else ' of an even width'})")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"--chunk {chunk!r} must be a positive number of steps")
    if not 0 <= warmup < steps:
        raise ValueError(f"--warmup {warmup} must be in [0, --steps) = [0, {steps})")
    return device


def _print_header(model, hidden, ffn, batch_size, steps, warmup, chunk, first_seed, seeds,
                  expert_ranks, ladder, target, device, graph, max_graphs) -> None:
    kept = "every rung's" if max_graphs is None else f"{max_graphs} rungs'"
    graphs = f", graphed (the ladder keeps {kept} graphs)" if graph else ""
    print(f"bench adaptive --model {model} (hidden {hidden}, ffn {ffn}, {batch_size} x 32 "
          f"tokens a step): {steps} steps a run (the first {warmup} not "
          f"timed; the runs of a seed in lockstep, {chunk} steps at a time), seeds "
          f"{first_seed}..{first_seed + seeds - 1}, expert_ranks "
          f"{expert_ranks}; ladder {ladder.rungs}, "
          f"target rerun rate {target}, window {ladder.steps_seen}; "
          f"{device}{', one thread' if device.type == 'cpu' else ''}"
          f"{graphs}", flush=True)


def _summary(figures, names, steps, target, seeds, fixed) -> None:
    ada = figures["adaptive"]
    best = [min((figures[n][s] for n in names[:fixed]), key=lambda f: f.seconds)
            for s in range(seeds)]
    print("(rr: steps that reran; ms: mean time a step after the warm-up, reruns included: "
          "CPU time on the CPU, wall time on CUDA; budget: rows a rank may take a step, "
          "summed over the layers)")
    print(f"\nmean over {seeds} seeds:")
    print(f"{'run':<10}{'rerun rate':>12}{'ms/step':>10}{'budget':>10}{'peak MiB':>10}")
    for n in names:
        fs = figures[n]
        peaks = [f.peak for f in fs if f.peak is not None]
        peak = f"{statistics.mean(peaks) / 2**20:.0f}" if peaks else "-"
        print(f"{n:<10}{statistics.mean(f.reruns for f in fs) / steps:>12.3f}"
              f"{statistics.mean(f.seconds for f in fs) * 1e3:>10.2f}"
              f"{statistics.mean(f.budget for f in fs):>10.0f}{peak:>10}")
    spreads = []
    for s in range(seeds):
        clean = [figures[n][s].seconds for n in names[:fixed] if figures[n][s].reruns == 0]
        if len(clean) > 1:
            spreads.append(max(clean) / min(clean) - 1)
    if spreads:
        print(f"timing noise: the runs at rungs that never reran spread by "
              f"{statistics.mean(spreads):.1%} a seed on average (slowest over fastest)")
    print(f"the ladder's reruns per run: {statistics.mean(f.reruns - f.exact for f in ada):.1f} "
          f"at a rung that fit, {statistics.mean(f.exact for f in ada):.1f} on the exact path "
          f"(mean over the seeds)")
    if any(f.captures for f in ada):
        print(f"graphs the ladder captured per run: "
              f"{', '.join(str(f.captures) for f in ada)} (a fixed rung: 1)")
    top = names[fixed - 1]
    for name in names[fixed:]:
        runs = figures[name]
        rate = statistics.mean(f.reruns for f in runs) / steps
        ratio = statistics.mean(a.seconds / b.seconds for a, b in zip(runs, best))
        held = [held_out_ratio(a, [figures[n][s] for n in names[:fixed]])
                for s, a in enumerate(runs)]
        budget = statistics.mean(a.budget / b.budget for a, b in zip(runs, best))
        held = f" ({statistics.mean(held):.3f}x the rung chosen on the other half of the " \
               f"steps)" if None not in held else ""
        print(f"{name}: rerun rate {rate:.3f} = {rate / target:.2f}x the target {target} "
              f"(goal 0.5-1.5x); time {ratio:.3f}x the best fixed rung of each seed{held} "
              f"(goal <= 1.03); budget {budget:.3f}x the best fixed rung's", end="")
        if runs[0].peak is not None:
            over = max(a.peak / t.peak for a, t in zip(runs, figures[top]))
            print(f"; peak at most {over:.2f}x the top rung's ({top}; goal <= 1.00)", end="")
        print(flush=True)
