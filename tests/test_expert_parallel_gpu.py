"""On 2 CUDA devices (NCCL): the expert-parallel capacity attempt never syncs on any rank, its
gradients match the exact path, and run-to-run results are bitwise equal. Skipped elsewhere."""

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pagedstash_func as psf

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

E, H, F, K, T = 16, 256, 192, 4, 1024


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        out.put((rank, _checks(rank)))
    except Exception:
        out.put((rank, "FAILED\n" + traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _checks(rank):
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
    b = psf.run_step(step, params, batch, state)
    same = all(torch.equal(a.grads[n], b.grads[n]) for n in a.grads)
    return flags, rel, same, a.report.reran


def test_capacity_attempt_syncs_nowhere_and_matches_exact():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, value in results.items():
        assert not isinstance(value, str), value
        flags, rel, same, reran = value
        assert not flags["over_budget"] and not flags["overflow"]
        assert rel < 1e-2 and same and not reran, (rank, rel, same, reran)
