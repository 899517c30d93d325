"""run_micro_batches: the gradients of the concatenated batch (fp64), only the micro-batch
that flagged reruns, and bad arguments name the fix."""

import pytest
import torch
import torch.utils._pytree as pytree

import pagedstash_func as psf

E, H, F, K, T = 8, 16, 24, 2, 32


def _loss(params, batch):
    ids = batch["ids"]
    w = torch.full(ids.shape, 0.5, dtype=torch.float64)
    y = psf.moe(params, batch["x"], top_k=K, routing=(ids, w))
    return (y * batch["x"]).sum() / T


def _micro(i, skewed=False):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    if skewed:          # every pair to experts 0 and 1: over budget on two virtual ranks
        ids = torch.stack([torch.zeros(T, dtype=torch.int64), torch.ones(T, dtype=torch.int64)],
                          1)
    else:
        ids = torch.randint(0, E, (T, K), generator=g)
        ids[:, 1] = (ids[:, 0] + 1 + torch.randint(0, E - 1, (T,), generator=g)) % E
    return {"x": x, "ids": ids}


@pytest.mark.parametrize("stash", [False, True])
def test_micro_batches_equal_the_whole_batch_and_only_the_flagged_one_reruns(stash):
    params = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                          dtype=torch.float64)
    micro = [_micro(0), _micro(1, skewed=True), _micro(2)]
    cfg = psf.StashConfig(capacity_factor=1.25, expert_ranks=2, paged_stash=stash,
                          page_size=8)
    step = psf.stash_aware(_loss, cfg)
    res = psf.run_micro_batches(step, params, micro, step.init(params, micro[0]))
    assert res.reran == (1,)
    whole = {k: torch.cat([m[k] for m in micro]) for k in micro[0]}

    def whole_loss(p):            # the mean of the three micro-batch losses
        return sum(_loss(p, {k: v[i * T:(i + 1) * T] for k, v in whole.items()})
                   for i in range(3)) / 3

    ref = torch.func.grad(whole_loss)(params)
    for a, b in zip(pytree.tree_leaves(res.grads), pytree.tree_leaves(ref)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(res.loss, whole_loss(params), rtol=1e-12, atol=0)
    weighted = psf.run_micro_batches(step, params, micro, res.state, weights=[1.0, 0.0, 2.0])
    manual = [psf.run_step(step, params, m, step.init(params, m)).grads for m in micro]
    for k in ref:
        torch.testing.assert_close(weighted.grads[k], manual[0][k] + 2 * manual[2][k],
                                   rtol=1e-12, atol=1e-13)


def test_bad_arguments_name_the_fix():
    params = psf.moe_init(E, H, F, dtype=torch.float64)
    step = psf.stash_aware(_loss, psf.StashConfig(capacity_factor=1.25))
    state = step.init(params, _micro(0))
    with pytest.raises(ValueError, match="non-empty list of micro-batches"):
        psf.run_micro_batches(step, params, _micro(0), state)
    with pytest.raises(ValueError, match="non-empty list"):
        psf.run_micro_batches(step, params, [], state)
    with pytest.raises(ValueError, match="one per micro-batch"):
        psf.run_micro_batches(step, params, [_micro(0)], state, weights=[1.0, 2.0])
    with pytest.raises(TypeError, match="psf.stash_aware"):
        psf.run_micro_batches(_loss, params, [_micro(0)], state)


def test_a_micro_batch_without_labels_adds_nothing_and_the_loss_is_the_whole_batchs():
    """A from_hf_model loss on a micro-batch whose labels are all -100 is NaN (0 / 0, as
    transformers' is); weighted by label shares (0 for it), the loss and gradients equal the
    whole batch's."""
    pytest.importorskip("transformers")
    import sys
    sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/interop")
    from hf_tiny import lm_batch, tiny_model
    model = tiny_model("qwen3_moe")
    params, loss_fn = psf.from_hf_model(model)
    batch = lm_batch(batch=4, seq=10)
    batch["labels"][2:] = -100                            # the second half predicts nothing
    micro = [{k: v[i:i + 2] for k, v in batch.items()} for i in (0, 2)]
    assert torch.isnan(loss_fn(params, micro[1])[0])
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=2.0, paged_stash=True))
    res = psf.run_micro_batches(step, params, micro, step.init(params, micro[0]),
                                weights=[1.0, 0.0])
    whole, (loss, _) = psf.value_and_grad(loss_fn, has_aux=True)(params, batch)
    torch.testing.assert_close(res.loss, loss, rtol=1e-6, atol=0)
    mine, ref = psf.to_hf_state_dict(res.grads, model), psf.to_hf_state_dict(whole, model)
    for name in ref:
        torch.testing.assert_close(mine[name], ref[name], rtol=1e-4, atol=1e-6)
    first = psf.run_micro_batches(step, params, micro[::-1], res.state, weights=[0.0, 1.0])
    torch.testing.assert_close(first.loss, loss, rtol=1e-6, atol=0)     # zero weight first


def test_a_call_that_fails_part_way_says_so_and_the_state_recovers():
    """Micro-batch 1 of 3 has another shape: the error is run_step's; the caller's state,
    consumed by micro-batch 0, then names this call as its consumer and the way back."""
    params = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                          dtype=torch.float64)
    good = _micro(0)
    short = {k: v[:T // 2] for k, v in _micro(1).items()}
    cfg = psf.StashConfig(capacity_factor=1.25, expert_ranks=2, paged_stash=True, page_size=8)
    step = psf.stash_aware(_loss, cfg)
    state = step.init(params, good)
    with pytest.raises(psf.StateMismatchError, match="does not match the state"):
        psf.run_micro_batches(step, params, [good, short, good], state)
    with pytest.raises(psf.ConsumedStateError, match=r"(?s)run_micro_batches, which failed at "
                                                     r"micro-batch 1 of 3.*psf.reset\(state\)"):
        psf.run_step(step, params, good, state)
    res = psf.run_step(step, params, good, psf.reset(state))
    ref = psf.run_step(step, params, good, step.init(params, good))
    assert all(torch.equal(res.grads[k], ref.grads[k]) for k in ref.grads)


def test_weights_as_tensors_and_a_failure_while_accumulating():
    """Label counts taken from aux are one-element tensors: accepted as weights. A weight the
    gradients' dtype cannot take fails after micro-batch 0's step consumed the state, and the
    state says so."""
    params = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0))
    micro = [{"x": _micro(i)["x"].float()} for i in (0, 1)]

    def loss(p, b):
        return psf.moe(p, b["x"], top_k=K).square().mean()
    step = psf.stash_aware(loss, psf.StashConfig(capacity_factor=2.0, expert_ranks=2))
    state = step.init(params, micro[0])
    res = psf.run_micro_batches(step, params, micro, state,
                                weights=[torch.tensor(0.25), torch.tensor([0.75])])
    ref = psf.run_micro_batches(step, params, micro, res.state, weights=[0.25, 0.75])
    torch.testing.assert_close(res.loss, ref.loss, rtol=0, atol=0)
    state = ref.state
    with pytest.raises(RuntimeError):
        psf.run_micro_batches(step, params, micro, state, weights=[1.0, 1e300])
    with pytest.raises(psf.ConsumedStateError, match="failed at micro-batch 1 of 2"):
        psf.run_step(step, params, micro[0], state)
