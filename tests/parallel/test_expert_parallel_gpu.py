"""On 2 CUDA devices (NCCL, NVSHMEM): the expert-parallel capacity attempt never syncs on any
rank, its gradients match the exact path, run-to-run results, eager and graph-replayed, are
bitwise equal (with the pools shared or each layer's own), and the two transports (fixed
slots, NVSHMEM) give the same bits. Skipped elsewhere."""

import pytest
import torch
import torch.distributed as dist
from worlds import no_failures, spawn_world
from sync_free import without_sync

import pagedstash_func as psf

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

E, H, F, K, T = 16, 256, 192, 4, 1024


def capacity_attempt(rank, world, pool_scope="state"):
    group = dist.group.WORLD
    full = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                        dtype=torch.bfloat16, device="cuda")
    params = psf.shard_experts(full, group)
    gen = torch.Generator().manual_seed(1 + rank)
    batch = {"x": torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16),
             "c": torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)}

    def loss_fn(p, b):
        return (psf.moe(p, b["x"], top_k=K, group=group).float() * b["c"].float()).sum()

    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=2.0, paged_stash=True,
                                                    pool_scope=pool_scope))
    state = step.init(params, batch)
    attempt = torch.func.grad_and_value(step.attempt, has_aux=True)
    attempt(params, batch, state.clone())               # warm up: compile, NCCL channels
    grads, (loss, new_state) = without_sync(attempt, params, batch, state.clone())
    flags = psf.read_flags(new_state)
    exact = torch.func.grad(loss_fn)(params, batch)
    rel = max(((grads[n].float() - exact[n].float()).norm() / exact[n].float().norm()).item()
              for n in exact)
    a = psf.run_step(step, params, batch, state.clone())
    g = psf.graphed(step)(params, batch, state.clone())   # NCCL collectives inside the graph
    b = psf.run_step(step, params, batch, state)
    same = all(torch.equal(a.grads[n], b.grads[n]) and torch.equal(a.grads[n], g.grads[n])
               for n in a.grads)
    return flags, rel, same, a.report.reran, {n: t.cpu() for n, t in a.grads.items()}


def layer_pools_attempt(rank, world):
    """The same with pool_scope="layer" (the fc1 input and gate_up in pools of each call's
    own, allocated and freed inside the step, inside the graph too)."""
    return capacity_attempt(rank, world, pool_scope="layer")


def transports_agree(rank, world):
    """Fixed slots and NVSHMEM: equal losses and gradients, bit for bit, over several routings,
    with everything kept (cf 2) and with drops (cf 0.5); many exchanges back to back."""
    from pagedstash_func.parallel import _symmetric
    if _symmetric.unavailable(dist.group.WORLD) is not None:
        return "skip: " + _symmetric.unavailable(dist.group.WORLD)
    group = dist.group.WORLD
    params = psf.shard_experts(psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                                            dtype=torch.bfloat16, device="cuda"), group)
    results = []
    for seed in range(3):
        gen = torch.Generator().manual_seed(10 * seed + rank)
        batch = {"x": torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16),
                 "c": torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)}

        def loss_fn(p, b):
            y = psf.moe(p, b["x"], top_k=K, group=group)
            y = psf.moe(p, y, top_k=K, group=group)               # two layers
            return (y.float() * b["c"].float()).sum()

        for cf in (2.0, 0.5):
            outs = []
            for transport in ("fixed", "nvshmem"):
                step = psf.stash_aware(loss_fn, psf.StashConfig(
                    capacity_factor=cf, paged_stash=True, transport=transport))
                attempt = torch.func.grad_and_value(step.attempt, has_aux=True)
                grads, (loss, state) = attempt(params, batch, step.init(params, batch))
                outs.append((grads, loss, psf.read_flags(state)["over_budget"]))
            (g0, l0, o0), (g1, l1, o1) = outs
            results.append((cf, o0, o1, torch.equal(l0, l1) and
                            all(torch.equal(g0[n], g1[n]) for n in g0)))
    return results


@pytest.mark.parametrize("name", ["capacity_attempt", "layer_pools_attempt"])
def test_a_capacity_attempt_syncs_nowhere_and_matches_exact(ranks, name):
    """The shared pool's attempt, and the layer pools' giving the shared pool's bits."""
    values = ranks[name]
    no_failures(values)
    for rank, (flags, rel, same, reran, grads) in enumerate(values):
        assert not flags["over_budget"] and not flags["overflow"]
        assert rel < 1e-2 and same and not reran, (rank, rel, same, reran)
        if name == "layer_pools_attempt":
            shared = ranks["capacity_attempt"][rank][4]
            assert all(torch.equal(grads[n], shared[n]) for n in shared), rank


def test_transports_give_the_same_bits(ranks):
    values = ranks["transports_agree"]
    no_failures(values)
    if isinstance(values[0], str):
        pytest.skip(values[0])
    for per_rank in values:
        for cf, over_fixed, over_nvshmem, same in per_rank:
            assert same and over_fixed == over_nvshmem == (cf < 1), (cf, same)


@pytest.fixture(scope="module")
def ranks():
    return spawn_world(2, [capacity_attempt, layer_pools_attempt, transports_agree],
                       backend="nccl")
