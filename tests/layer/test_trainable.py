"""psf.trainable and psf.set_grads: what an optimizer steps, and its gradients handed over by
place in the tree, or refused with nothing assigned."""

import pytest
import torch

import pagedstash_func as psf


def _tree():
    g = torch.Generator().manual_seed(0)
    layer = psf.moe_init(4, 8, 12, generator=g)
    layer["router_bias"] = torch.zeros(4)
    return {"head": torch.randn(8, 3, generator=g), "layers": [layer]}


def test_the_bias_is_left_out_and_gradients_go_by_place_not_order():
    params = _tree()
    leaves = psf.trainable(params)
    assert len(leaves) == 4 and not any(t is params["layers"][0]["router_bias"]
                                        for t in leaves)
    grads = torch.utils._pytree.tree_map(torch.ones_like, params)
    grads = {"layers": [dict(reversed(list(grads["layers"][0].items())))],
             "head": grads["head"] * 2}                        # another order of the keys
    psf.set_grads(params, grads)
    assert torch.equal(params["head"].grad, grads["head"])
    assert params["layers"][0]["w_down"].grad is grads["layers"][0]["w_down"]
    assert params["layers"][0]["router_bias"].grad is None
    opt = torch.optim.SGD(leaves, lr=0.1, weight_decay=0.5)
    bias = params["layers"][0]["router_bias"].clone()
    opt.step()
    assert torch.equal(params["layers"][0]["router_bias"], bias)


@pytest.mark.parametrize("edit, said", [
    (lambda g: g.pop("head"), r"params\['head'\] has no gradient there"),
    (lambda g: g.update(extra=torch.ones(1)), r"grads\['extra'\] has no parameter there"),
    (lambda g: g.update(head=None), r"grads\['head'\] is None \(no gradient\)"),
    (lambda g: g.update(head=g["head"].double()), r"grads\['head'\] is torch.float64"),
    (lambda g: g.update(head=g["head"][:2]), r"grads\['head'\] is .* \[2, 3\]"),
])
def test_mismatched_gradients_are_refused_and_nothing_is_assigned(edit, said):
    params = _tree()
    grads = torch.utils._pytree.tree_map(torch.ones_like, params)
    edit(grads)
    with pytest.raises(ValueError, match=said):
        psf.set_grads(params, grads)
    assert all(t.grad is None for t in psf.trainable(params))


def test_one_tensor_at_two_places_is_refused():
    t = torch.zeros(2)
    with pytest.raises(ValueError, match=r"params\['y'\] is the same tensor as params\['x'\]"):
        psf.set_grads({"x": t, "y": t}, {"x": torch.ones(2), "y": torch.ones(2) * 2})
