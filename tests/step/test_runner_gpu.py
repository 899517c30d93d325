"""On CUDA only: a run_step attempt never syncs; run_step and replay are bit for bit."""

import pytest
import torch
import torch.utils._pytree as pytree
from sync_free import without_sync

import pagedstash_func as psf
from pagedstash_func.cli import _demo as demo

pytestmark = pytest.mark.gpu


def demo_setup(cfg, seed=0, dtype=torch.float32):
    text = demo.corpus()
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text])
    params = demo.init_model(len(vocab), hidden=128, ffn=256, experts=8, layers=3, seq=64,
                             seed=seed, device="cuda")
    params = pytree.tree_map(lambda t: t.to(dtype), params)
    batch = {k: v.cuda() for k, v in demo.make_batch(data, 0, batch_size=32, seq=64,
                                                      seed=seed).items()}
    step = psf.stash_aware(demo.loss_fn, cfg)
    return step, params, batch


@pytest.mark.parametrize("host_factor", [0.0, 1.0])
def test_attempt_one_of_run_step_does_not_sync(host_factor):
    cfg = psf.StashConfig(capacity_factor=1.25, paged_stash=True, expert_ranks=2,
                          cuda_factor=0.4 if host_factor else 1.0, host_factor=host_factor)
    # bf16: torch._grouped_mm runs the expert GEMMs with offsets on the device. (fp32 experts
    # fall back to a loop over groups that reads the offsets on the host.)
    step, params, batch = demo_setup(cfg, dtype=torch.bfloat16)
    state = step.init(params, batch)
    attempt = torch.func.grad_and_value(step, has_aux=True)
    attempt(params, batch, state.clone())        # warm up
    grads, (loss, (aux, state)) = without_sync(attempt, params, batch, state)
    assert psf.read_flags(state)["host_spill"] == bool(host_factor)
    assert torch.isfinite(loss)


def test_run_step_and_replay_bit_for_bit_under_deterministic_mode(tmp_path):
    cfg = psf.StashConfig(capacity_factor=1.1, paged_stash=True, expert_ranks=2,
                          cuda_factor=0.5, host_factor=0.5)
    step, params, batch = demo_setup(cfg, seed=1)
    state = step.init(params, batch)
    path = tmp_path / "step.pt"
    psf.save_step(path, step, params, batch, state)
    twin = state.clone()
    torch.use_deterministic_algorithms(True)
    try:
        results = [psf.run_step(step, params, batch, state),
                   psf.run_step(step, params, batch, twin),
                   psf.replay_step(path, demo.loss_fn)]
    finally:
        torch.use_deterministic_algorithms(False)
    first = results[0]
    for other in results[1:]:
        assert torch.equal(first.loss, other.loss)
        for a, b in zip(pytree.tree_leaves(first.grads), pytree.tree_leaves(other.grads)):
            assert torch.equal(a, b)
        assert first.report == other.report


def test_pages_of_an_output_that_never_reaches_the_loss_are_reclaimed_on_the_gpu():
    params = [psf.moe_init(8, 64, 96, generator=torch.Generator().manual_seed(i),
                           dtype=torch.bfloat16, device="cuda") for i in range(2)]
    batch = {"x": torch.randn(256, 64, generator=torch.Generator().manual_seed(9)).to(
        "cuda", torch.bfloat16)}

    def loss_fn(p, b):
        y0 = psf.moe(p[0], b["x"], top_k=2)
        y1 = psf.moe(p[1], b["x"], top_k=2)               # reaches aux only
        return y0.float().pow(2).mean(), {"y1": y1.detach().float().sum()}

    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=2.0, paged_stash=True,
                                                    cuda_factor=1.0))
    res = psf.run_step(step, params, batch, step.init(params, batch))
    assert res.report.unconsumed == ("moe1",)
    assert all(v["cuda_used"] == 0 for v in psf.pages_in_use(res.state).values())
    twin = res.state.clone()
    psf.validate_state(twin)


def test_a_flag_read_made_while_another_waits_reads_its_own_values():
    """A read made inside ``while_waiting`` (another step's, say) takes a buffer of its own:
    the outer read still returns its own values, not the inner one's."""
    from pagedstash_func.step import _runner
    a = torch.ones(1, 8, device="cuda", dtype=torch.int64)
    b = a * 2
    torch.cuda._sleep(10**8)                 # the outer copy is still queued behind this
    inner = []
    outer = _runner._to_host(a, lambda: inner.append(_runner._to_host(b)))
    assert outer == [[1] * 8] and inner == [[[2] * 8]]
    assert _runner._to_host(b) == [[2] * 8] and _runner._to_host(a) == [[1] * 8]
