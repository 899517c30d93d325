"""On 2 CUDA devices (NCCL): the expert-parallel capacity attempt never syncs on any rank, its
gradients match the exact path, and run-to-run results, eager and graph-replayed, are bitwise
equal. Skipped elsewhere."""

import pytest
import torch
import torch.distributed as dist
from worlds import no_failures, spawn_world

import pagedstash_func as psf

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

E, H, F, K, T = 16, 256, 192, 4, 1024


def capacity_attempt(rank, world):
    group = dist.group.WORLD
    full = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                        dtype=torch.bfloat16, device="cuda")
    params = psf.shard_experts(full, group)
    gen = torch.Generator().manual_seed(1 + rank)
    batch = {"x": torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16),
             "c": torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)}

    def loss_fn(p, b):
        return (psf.moe(p, b["x"], top_k=K, group=group).float() * b["c"].float()).sum()

    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=2.0, paged_stash=True))
    state = step.init(params, batch)
    attempt = torch.func.grad_and_value(step.attempt, has_aux=True)
    attempt(params, batch, state.clone())               # warm up: compile, NCCL channels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads, (loss, new_state) = attempt(params, batch, state.clone())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    flags = psf.read_flags(new_state)
    exact = torch.func.grad(loss_fn)(params, batch)
    rel = max(((grads[n].float() - exact[n].float()).norm() / exact[n].float().norm()).item()
              for n in exact)
    a = psf.run_step(step, params, batch, state.clone())
    g = psf.graphed(step)(params, batch, state.clone())   # NCCL collectives inside the graph
    b = psf.run_step(step, params, batch, state)
    same = all(torch.equal(a.grads[n], b.grads[n]) and torch.equal(a.grads[n], g.grads[n])
               for n in a.grads)
    return flags, rel, same, a.report.reran


def test_capacity_attempt_syncs_nowhere_and_matches_exact():
    values = spawn_world(2, [capacity_attempt], backend="nccl")["capacity_attempt"]
    no_failures(values)
    for rank, (flags, rel, same, reran) in enumerate(values):
        assert not flags["over_budget"] and not flags["overflow"]
        assert rel < 1e-2 and same and not reran, (rank, rel, same, reran)
