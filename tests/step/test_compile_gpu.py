"""torch.compile over a capacity attempt on the GPU (bf16 experts through torch._grouped_mm):
without the stash it traces whole and gives eager's numbers; with the stash, through graph
breaks, eager's numbers and every page back."""

import pytest
import torch

import pagedstash_func as psf

pytestmark = pytest.mark.gpu


def _setup(stash):
    torch.manual_seed(0)
    params = [{k: v.to("cuda", torch.bfloat16).requires_grad_()
               for k, v in psf.moe_init(16, 256, 128).items()} for _ in range(2)]
    batch = {"x": torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)}

    def loss_fn(params, batch):
        x = batch["x"]
        for p in params:
            x = x + psf.moe(p, torch.tanh(x), top_k=2)
        return x.float().square().mean()
    cfg = psf.StashConfig(capacity_factor=1.25, paged_stash=stash, expert_ranks=2)
    return params, batch, psf.stash_aware(loss_fn, cfg)


def _run(attempt, params, batch, step):
    loss, state = attempt(params, batch, step.init(params, batch))
    leaves = [v for p in params for v in p.values()]
    return loss, torch.autograd.grad(loss, leaves), state


@pytest.mark.parametrize("stash", [False, True])
def test_a_compiled_attempt_equals_eager_on_the_gpu(stash):
    torch._dynamo.reset()
    params, batch, step = _setup(stash)
    if not stash:
        explained = torch._dynamo.explain(step.attempt)(params, batch, step.init(params, batch))
        assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    eager = _run(step.attempt, params, batch, step)
    compiled = _run(torch.compile(step.attempt, fullgraph=not stash), params, batch, step)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-2, atol=1e-3)     # bf16
    for a, b in zip(compiled[1], eager[1]):
        scale = b.float().abs().max().clamp_min(1e-6)
        assert ((a.float() - b.float()).abs().max() / scale) < 2e-2
    assert torch.equal(compiled[2].flags, eager[2].flags)
    assert all(v["cuda_used"] == 0 for v in psf.pages_in_use(compiled[2]).values())
