"""`bench adaptive`: the demo's model trained with `psf.adaptive` beside the same run at each
fixed rung of its ladder, per seed: reruns and mean step time (reruns included).

A fixed factor chosen in hindsight is the one whose run was fastest; the adaptive run is read
against it. Runs on the CPU (the demo's fp32 model) or on CUDA (bf16 experts).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.utils._pytree as pytree

import pagedstash_func as psf

from .. import _demo as demo


def _run(runner, params, batches, device):
    """``(reruns, seconds per step)`` of one training run (Adam, the demo's loss)."""
    moments = (pytree.tree_map(torch.zeros_like, params),) * 2
    reruns, seconds = 0, []
    for i, batch in enumerate(batches):
        began = time.perf_counter()
        res = runner(params, batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - began)
        reruns += res.report.reran
        params, moments = demo.adam(params, res.grads, moments, i + 1)
    return reruns, statistics.mean(seconds[2:] or seconds)


def bench_adaptive(steps=100, seeds=2, rungs=(1.0, 1.1, 1.25, 1.5, 2.0), target=0.02,
                   device="cpu", expert_ranks=2, progress=True):
    """Print one row per seed: reruns and ms/step of each fixed rung and of the ladder."""
    from tqdm.auto import tqdm
    device = torch.device(device)
    ladder = psf.Ladder(rungs=tuple(rungs), target_rerun_rate=target)
    text = demo.corpus()
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text])
    cfg = psf.StashConfig(capacity_factor=rungs[-1], paged_stash=True, pool_scope="layer",
                          expert_ranks=expert_ranks)
    dtype = torch.bfloat16 if device.type == "cuda" else None
    loss_fn = demo.make_loss_fn(None, dtype)
    print(f"bench adaptive: the demo's model, {steps} steps a run, seeds 0..{seeds - 1}, "
          f"expert_ranks {expert_ranks}; ladder {ladder.rungs}, target rerun rate {target}, "
          f"window {ladder.steps_seen}; {device}", flush=True)
    names = [f"cf {r}" for r in ladder.rungs] + ["adaptive"]
    print(f"{'seed':<6}" + "".join(f"{n:>18}" for n in names) + f"{'best fixed':>14}"
          f"{'adaptive / best':>17}")
    bar = tqdm(total=seeds * len(names), desc="runs", disable=not progress, leave=False)
    for seed in range(seeds):
        params = demo.init_model(len(vocab), seed=seed, device=device)
        batches = [{k: v.to(device) for k, v in demo.make_batch(
            data, i, batch_size=16, seq=32, seed=seed).items()} for i in range(steps)]
        rows = []
        for r in ladder.rungs:
            step = psf.stash_aware(loss_fn, dataclasses.replace(cfg, capacity_factor=r))
            box = {"state": step.init(params, batches[0])}

            def fixed(p, b, step=step, box=box):
                res = psf.run_step(step, p, b, box["state"])
                box["state"] = res.state
                return res
            rows.append(_run(fixed, params, batches, device))
            bar.update()
        astep = psf.adaptive(loss_fn, cfg, ladder)
        abox = {"state": astep.init(params, batches[0])}

        def adapt(p, b):
            res, abox["state"] = astep(p, b, abox["state"])
            return res
        rows.append(_run(adapt, params, batches, device))
        bar.update()
        best = min(rows[:-1], key=lambda r: r[1])
        cells = "".join(f"{f'{n} rr, {s * 1e3:.1f} ms':>18}" for n, s in rows)
        print(f"{seed:<6}{cells}{best[1] * 1e3:>11.1f} ms{rows[-1][1] / best[1]:>17.3f}",
              flush=True)
    bar.close()
    print("(rr: steps that reran; ms: mean seconds a step after the first two, reruns "
          "included)", flush=True)
