"""`psf.compile` on the GPU (Inductor, bf16 experts through torch._grouped_mm, Triton kernels
as custom ops): a compiled step gives the eager step's numbers with and without the stash, its
attempt and backward never wait for the device, and under deterministic mode two compiled runs,
and a replay of one from its step file, are bit-equal."""

import pytest
import torch
from torch.utils._pytree import tree_leaves

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
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        attempt(state)
    finally:
        torch.cuda.set_sync_debug_mode(0)


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
