"""`psf.compile` on the GPU (Inductor, bf16 experts through torch._grouped_mm, Triton kernels
as custom ops): a compiled step gives the eager step's numbers with and without the stash, its
attempt and backward never wait for the device, and under deterministic mode two compiled runs,
and a replay of one from its step file, are bit-equal."""

import dataclasses

import pytest
import torch
from torch.utils._pytree import tree_leaves
from sync_free import without_sync

import pagedstash_func as psf

pytestmark = pytest.mark.gpu


def _setup(stash, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [{k: v.to("cuda", torch.bfloat16).requires_grad_()
               for k, v in psf.moe_init(16, 256, 128, generator=g).items()} for _ in range(2)]
    pad = torch.zeros(512, dtype=torch.bool)
    pad[torch.randperm(512, generator=g)[:128]] = True
    batch = {"x": torch.randn(512, 256, generator=g).to("cuda", torch.bfloat16),
             "pad": pad.cuda()}

    def loss_fn(params, batch):
        # routed from the batch: a routing decision near a tie would follow bf16 rounding,
        # which compiled code does otherwise (fused), and the loads are compared exactly
        x = batch["x"]
        for p in params:
            h = torch.tanh(x)
            ids, weights = psf.route(p["router"], batch["x"], 2)
            ids = ids.masked_fill(batch["pad"][:, None], -1)
            x = x + psf.moe(p, h, top_k=2, routing=(ids, weights))
        return x.float().square().mean()
    cfg = psf.StashConfig(capacity_factor=1.25, paged_stash=stash, pool_scope="layer",
                          cuda_factor=0.9, expert_ranks=2)
    return params, batch, psf.stash_aware(loss_fn, cfg)


def _close(a, b):
    """bf16: Inductor fuses the elementwise ops around the kernels (one rounding where eager
    rounds per op), so the two agree to bf16's precision, not bitwise."""
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-2, atol=1e-3)
    for x, y in zip(tree_leaves(a.grads), tree_leaves(b.grads)):
        scale = y.float().abs().max().clamp_min(1e-6)
        assert ((x.float() - y.float()).abs().max() / scale) < 2e-2


@pytest.mark.parametrize("stash", [False, True])
def test_a_compiled_step_equals_eager_on_the_gpu(stash):
    torch._dynamo.reset()
    params, batch, step = _setup(stash)
    compiled = psf.compile(step)
    a_state, b_state = compiled.init(params, batch), step.init(params, batch)
    for _ in range(3):
        a = psf.run_step(compiled, params, batch, a_state)
        b = psf.run_step(step, params, batch, b_state)
        a_state, b_state = a.state, b.state
        assert not a.report.reran and not b.report.reran
        assert a.report.pages_needed == b.report.pages_needed
        assert [r.expert_load for r in a.report.layers] == \
            [r.expert_load for r in b.report.layers]
        _close(a, b)


def test_a_compiled_attempt_and_its_backward_never_wait_for_the_device():
    torch._dynamo.reset()
    params, batch, step = _setup(True)
    compiled = psf.compile(step)
    leaves = [v for p in params for v in p.values()]

    def attempt(state):
        loss, state = compiled.attempt(params, batch, state)
        torch.autograd.grad(loss, leaves)
        return psf.reclaim(state)[0]
    state = attempt(attempt(compiled.init(params, batch)))     # compiled, then run once
    without_sync(attempt, state)


def test_compiled_runs_and_a_replay_are_bit_equal_under_deterministic_mode(tmp_path):
    torch._dynamo.reset()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            params, batch, step = _setup(True)
            compiled = psf.compile(step)
            state = compiled.init(params, batch)
            psf.save_step(tmp_path / "step.pt", step, params, batch, state)
            runs.append(psf.run_step(compiled, params, batch, state))
        again = psf.load_step(tmp_path / "step.pt", step.loss_fn)
        replay = psf.run_step(psf.compile(again[0]), *again[1:])
        for other in (runs[1], replay):
            assert torch.equal(runs[0].loss, other.loss)
            assert all(torch.equal(x, y) for x, y in zip(tree_leaves(runs[0].grads),
                                                         tree_leaves(other.grads)))
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_captured_compiled_step_equals_the_compiled_step_bit_for_bit():
    """`psf.graphed` over a `psf.compile` step: the compiled attempt, forward and backward,
    captured in one CUDA graph and replayed. Its losses, gradients and reports are the
    uncaptured compiled step's bit for bit (the same kernels, under deterministic mode),
    reruns included, and agree with the eager step to bf16's precision; a replay waits for
    the device only at the flag read."""
    torch._dynamo.reset()
    torch.use_deterministic_algorithms(True)
    try:
        params, batch, step = _setup(True)
        tight = psf.stash_aware(step.loss_fn, dataclasses.replace(step.cfg,
                                                                  capacity_factor=0.6))
        for base in (step, tight):                 # fits; over budget, so every step reruns
            compiled = psf.compile(base)
            gstep = psf.graphed(compiled)
            states = [compiled.init(params, batch) for _ in range(3)]
            for _ in range(3):
                a = gstep(params, batch, states[0])
                b = psf.run_step(compiled, params, batch, states[1])
                c = psf.run_step(base, params, batch, states[2])
                states = [a.state, b.state, c.state]
                assert a.report.reran == b.report.reran == c.report.reran == (base is tight)
                assert torch.equal(a.loss, b.loss)
                assert all(torch.equal(x, y) for x, y in zip(tree_leaves(a.grads),
                                                             tree_leaves(b.grads)))
                assert [r.expert_load for r in a.report.layers] == \
                    [r.expert_load for r in b.report.layers]
                assert a.report.pages_needed == b.report.pages_needed
                _close(a, c)
            assert gstep.captures == 1
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_compiled_ladder_replayed_from_graphs_equals_its_uncaptured_steps():
    """psf.adaptive(compiled=True, graph=True): each rung's compiled attempt captured in a
    graph of the ladder's shared pool. Over a run that moves down and reruns up, its moves and
    bits are those of the compiled ladder uncaptured, and its moves those of the eager ladder
    (routing given, so drops do not follow rounding), its numbers to bf16's precision; each
    rung compiles once."""
    torch._dynamo.reset()
    from moe_reference import two_rank_ids
    from torch._dynamo.utils import counters
    g = torch.Generator().manual_seed(3)
    params = {"a": psf.moe_init(16, 128, 96, generator=g, dtype=torch.bfloat16, device="cuda")}

    def loss(p, batch):
        w = torch.full(batch["ids"].shape, 0.5, dtype=torch.bfloat16, device="cuda")
        return psf.moe(p["a"], batch["x"], top_k=2, routing=(batch["ids"], w)).float() \
            .square().mean()
    ladder = psf.Ladder(rungs=(0.6, 1.0, 2.0), target_rerun_rate=0.2, window=3, start=0)
    cfg = psf.StashConfig(capacity_factor=1.0, paged_stash=True, expert_ranks=4,
                          pool_scope="layer")
    xs = [{"x": torch.randn(256, 128, generator=torch.Generator().manual_seed(i)).to(
               "cuda", torch.bfloat16) * (1 + (i % 3)),
           "ids": two_rank_ids(256, 16, (0.5, 0.95, 0.7)[i % 3],
                               torch.Generator().manual_seed(i)).cuda()} for i in range(8)]
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for compiled, graph in ((False, False), (True, False), (True, True)):
            before = counters["stats"]["unique_graphs"]
            astep = psf.adaptive(loss, cfg, ladder, graph=graph, compiled=compiled)
            astate = astep.init(params, xs[0])
            out = []
            for x in xs:
                res, astate = astep(params, x, astate)
                out.append((res.loss.clone(), res.report.reran,
                            {k: v.clone() for k, v in res.grads["a"].items()}))
            runs.append((out, astate.moves))
            if compiled:      # a forward graph per rung visited (the backward is not counted)
                visited = {m.rung for m in astate.moves} | {m.next_rung for m in astate.moves}
                assert counters["stats"]["unique_graphs"] - before == len(visited)
    finally:
        torch.use_deterministic_algorithms(False)
    (eager, moves_e), (comp, moves_c), (graphed, moves_g) = runs
    assert moves_e == moves_c == moves_g and any(m.rung != m.next_rung for m in moves_e)
    assert any(m.rerun for m in moves_e)
    for (lc, rc, gc), (lg, rg, gg), (le, re_, ge) in zip(comp, graphed, eager):
        assert rc == rg == re_
        assert torch.equal(lc, lg) and all(torch.equal(gc[k], gg[k]) for k in gc)
        torch.testing.assert_close(lc, le, rtol=1e-2, atol=1e-3)
        for k in ge:
            scale = ge[k].float().abs().max().clamp_min(1e-6)
            assert ((gc[k].float() - ge[k].float()).abs().max() / scale) < 2e-2
