"""`psf.value_and_grad`: first-order gradients through torch.autograd.grad, the same bits as
torch.func.grad_and_value on every path (exact, capacity with drops, the stash, the rerun)."""

import pytest
import torch
import torch.utils._pytree as pytree
from skewed_stack import loss_fn, make

import pagedstash_func as psf

def same_bits(a, b):
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x - y).abs().max()


CONFIGS = {
    "exact": psf.StashConfig(),
    "capacity": psf.StashConfig(capacity_factor=1.0, expert_ranks=4),
    "stash": psf.StashConfig(capacity_factor=1.0, expert_ranks=4, paged_stash=True),
    "stash-layer": psf.StashConfig(capacity_factor=1.0, expert_ranks=4, paged_stash=True,
                                   pool_scope="layer"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("skew", [0.0, 6.0])      # 6: expert 0 takes most pairs, drops
def test_same_bits_as_torch_func_on_every_path(name, skew):
    params, batch = make()
    batch["skew"][0] = skew
    step = psf.stash_aware(loss_fn, CONFIGS[name])
    ours_state, theirs_state = step.init(params, batch), step.init(params, batch)
    g1, (l1, (a1, s1)) = psf.value_and_grad(step, has_aux=True)(params, batch, ours_state)
    g2, (l2, (a2, s2)) = torch.func.grad_and_value(step, has_aux=True)(params, batch,
                                                                      theirs_state)
    same_bits((g1, l1, a1), (g2, l2, a2))
    same_bits(s1.flags, s2.flags)
    if name != "exact" and skew:
        assert psf.read_flags(s1)["over_budget"]        # the attempt really dropped pairs
    assert not l1.requires_grad and not a1["mean"].requires_grad


@pytest.mark.parametrize("name", ["capacity", "stash"])
def test_run_step_reruns_to_the_exact_gradients_bit_for_bit(name):
    params, batch = make()
    batch["skew"][0] = 6.0
    step = psf.stash_aware(loss_fn, CONFIGS[name])
    res = psf.run_step(step, params, batch, step.init(params, batch))
    assert res.report.reran and res.report.over_budget
    ref_grads, (ref_loss, ref_aux) = torch.func.grad_and_value(loss_fn, has_aux=True)(
        params, batch)
    same_bits((res.grads, res.loss, res.aux), (ref_grads, ref_loss, ref_aux))


def test_no_grad_attribute_written_and_inputs_untouched():
    params, batch = make()
    for p in pytree.tree_leaves(params):
        p.requires_grad_()
    before = [p.clone() for p in pytree.tree_leaves(params)]
    grads, loss = psf.value_and_grad(lambda p, b: loss_fn(p, b)[0])(params, batch)
    assert all(p.grad is None for p in pytree.tree_leaves(params))
    assert all(torch.equal(a, b) for a, b in zip(before, pytree.tree_leaves(params)))
    ref, _ = torch.func.grad_and_value(lambda p, b: loss_fn(p, b)[0])(params, batch)
    same_bits(grads, ref)


def test_argnums_tuple_and_unused_inputs_get_zeros():
    a, b, c = torch.randn(3), torch.randn(3), torch.randn(2)

    def f(a, b, c):
        return (a * b).sum() + 0 * a.sum()

    ours, v1 = psf.value_and_grad(f, argnums=(0, 2))(a, b, c)
    theirs, v2 = torch.func.grad_and_value(f, argnums=(0, 2))(a, b, c)
    same_bits((ours, v1), (theirs, v2))
    assert torch.equal(ours[1], torch.zeros(2))


def test_under_no_grad_it_still_differentiates():
    a = torch.randn(4)
    with torch.no_grad():
        g, v = psf.value_and_grad(lambda t: (t ** 2).sum())(a)
    assert torch.equal(g, 2 * a) and torch.equal(v, (a ** 2).sum())


def test_bad_inputs_name_the_fix():
    f = psf.value_and_grad(lambda p: p["w"].sum())
    with pytest.raises(ValueError, match=r"argument 0\['n'\] is a torch.int64 tensor"):
        f({"w": torch.randn(2), "n": torch.tensor([1])})
    with pytest.raises(ValueError, match=r"argument 0\['s'\] is a str"):
        f({"w": torch.randn(2), "s": "x"})
    with pytest.raises(ValueError, match="scalar tensor value.*has_aux=True"):
        psf.value_and_grad(lambda t: (t.sum(), {}))(torch.randn(2))
    with pytest.raises(ValueError, match="scalar tensor value"):
        psf.value_and_grad(lambda t: t * 2)(torch.randn(2))
    with pytest.raises(ValueError, match=r"\(value, aux\) pair"):
        psf.value_and_grad(lambda t: t.sum(), has_aux=True)(torch.randn(2))
    with pytest.raises(ValueError, match="argnums=3 but the function got 1"):
        psf.value_and_grad(lambda t: t.sum(), argnums=3)(torch.randn(2))
    with pytest.raises(ValueError, match="argnums must be"):
        psf.value_and_grad(lambda t: t.sum(), argnums=())
    with pytest.raises(TypeError, match="needs a callable"):
        psf.value_and_grad(3)


def test_a_stashed_step_frees_its_pages_and_refuses_a_consumed_state():
    params, batch = make()
    step = psf.stash_aware(loss_fn, CONFIGS["stash"])
    state = step.init(params, batch)
    _, (_, (_, new)) = psf.value_and_grad(step, has_aux=True)(params, batch, state)
    assert all(p["cuda_used"] == p["host_used"] == 0 for p in psf.pages_in_use(new).values())
    with pytest.raises(psf.ConsumedStateError):
        psf.value_and_grad(step, has_aux=True)(params, batch, state)


def test_what_torch_func_refuses_is_refused_too():
    x = torch.randn(3)
    with pytest.raises(ValueError, match="names an argument twice"):
        psf.value_and_grad(lambda a, b: (a * b).sum(), argnums=(0, -2))(x, x)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="inference_mode"):
            psf.value_and_grad(lambda a: a.sum())(torch.randn(3))
    with pytest.raises(ValueError, match="use torch.func.grad_and_value there"):
        torch.func.grad(lambda a: psf.value_and_grad(lambda b: b.sum())(a)[1])(x)
    with pytest.raises(ValueError, match="scalar tensor value"):
        psf.value_and_grad(lambda a: a.sum().reshape(1))(x)
