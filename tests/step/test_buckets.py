"""`pad_rows`: batches whose row count varies, padded to a few fixed sizes (one state each),
give the loss and gradients of the unpadded batch (fp64, against the exact path), and the
padding rows take no capacity."""

import pytest
import torch

import pagedstash_func as psf

E, H, F, K = 8, 16, 24, 2


def _loss(params, batch):
    """A mean over the rows that are not padding; padding rows routed away (id -1)."""
    x, pad = batch["x"], batch["pad"]
    ids, w = psf.route(params["router"], x, K)
    ids = torch.where(pad[:, None], -1, ids)
    y = psf.moe(params, torch.tanh(x), top_k=K, routing=(ids, w))
    keep = (~pad).to(y.dtype)
    return (y.square().sum(-1) * keep).sum() / keep.sum()


def _raw(rows, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, H, generator=g, dtype=torch.float64)
    return {"x": x, "pad": torch.rand(rows, generator=g) < 0.2}


def test_buckets_equal_the_unpadded_exact_path():
    params = psf.moe_init(E, H, F, generator=torch.Generator().manual_seed(0),
                          dtype=torch.float64)
    step = psf.stash_aware(_loss, psf.StashConfig(capacity_factor=2.0, expert_ranks=2,
                                                  paged_stash=True, page_size=8,
                                                  pool_scope="layer"))
    states, shapes = {}, set()
    for i, rows in enumerate((40, 57, 64, 13, 96)):
        raw = _raw(rows, i)
        padded = psf.pad_rows(raw, buckets=(64, 32, 96), fill={"x": 0.0})
        size = padded["x"].shape[0]
        assert size == min(b for b in (32, 64, 96) if b >= rows)
        assert torch.equal(padded["pad"][:rows], raw["pad"]) and padded["pad"][rows:].all()
        assert torch.equal(padded["x"][:rows], raw["x"]) and not padded["x"][rows:].any()
        state = states.get(size) or step.init(params, padded)
        res = psf.run_step(step, params, padded, state)
        states[size], shapes = res.state, shapes | {size}
        grads, loss = psf.value_and_grad(_loss)(params, raw)
        torch.testing.assert_close(res.loss, loss, rtol=1e-13, atol=0)
        for k in grads:
            torch.testing.assert_close(res.grads[k], grads[k], rtol=1e-12, atol=1e-14)
        valid = int((~raw["pad"]).sum())                # padding takes no capacity
        assert sum(res.report.layers[0].expert_load) == valid * K
    assert shapes == {32, 64, 96} and len(states) == 3


def test_other_entries_pass_and_a_new_mask_is_made():
    x, ids = torch.randn(5, 3), torch.arange(10).view(5, 2)
    out = psf.pad_rows({"x": x, "ids": ids, "lr": 0.1}, (8,), fill={"x": 0.0, "ids": -1})
    assert out["lr"] == 0.1 and out["x"].shape == (8, 3) and out["ids"][5:].eq(-1).all()
    assert out["pad"].tolist() == [False] * 5 + [True] * 3
    import numpy as np
    wide = psf.pad_rows({"x": x, "ids": ids}, (8,), fill={"x": float("-inf"),
                                                         "ids": np.int64(-1)})
    assert wide["x"][5:].eq(float("-inf")).all() and wide["ids"][5:].eq(-1).all()
    one = psf.pad_rows({"x": x, "z": torch.zeros(5, dtype=torch.complex64)}, (8,),
                       fill={"x": torch.tensor([2.0]), "z": 1 + 2j})
    assert one["x"][5:].eq(2).all() and one["z"][5:].eq(1 + 2j).all()
    cols = psf.pad_rows({"x": x.T.contiguous()}, (4, 6), fill={"x": 1.0}, dim=1)
    assert cols["x"].shape == (3, 6) and cols["x"][:, 5:].eq(1).all()


@pytest.mark.parametrize("batch, buckets, fill, kw, match", [
    ({"x": torch.zeros(9, 2)}, (8,), {"x": 0.0}, {}, "larger than the largest bucket"),
    ({"x": torch.zeros(4, 2)}, (), {"x": 0.0}, {}, "positive row counts"),
    ({"x": torch.zeros(4, 2)}, (0, 8), {"x": 0.0}, {}, "positive row counts"),
    ({"x": torch.zeros(4, 2)}, (4.5,), {"x": 0.0}, {}, "positive row counts"),
    ({"x": torch.zeros(4, 2)}, 8, {"x": 0.0}, {}, "positive row counts"),
    ({"x": torch.zeros(4, 2)}, (8,), {}, {}, "needs fill"),
    ({"x": torch.zeros(4, 2)}, (8,), {"y": 0.0}, {}, "does not hold"),
    ({"x": torch.zeros(4, 2), "y": torch.zeros(5)}, (8,), {"x": 0, "y": 0}, {},
     "different row counts"),
    ({"x": torch.zeros(4, 2)}, (8,), {"x": 0.0}, {"dim": 2}, "with a dim 2"),
    ({"x": torch.zeros(4, 2), "pad": torch.zeros(4)}, (8,), {"x": 0.0}, {}, "bool"),
    ({"x": torch.zeros(4, 2), "pad": torch.zeros(3, dtype=torch.bool)}, (8,), {"x": 0.0},
     {}, r"bool \[4\]"),
    ({"x": torch.zeros(4, 2), "pad": torch.zeros(4, dtype=torch.bool)}, (8,),
     {"x": 0.0, "pad": True}, {}, "leave it out of fill"),
    ([torch.zeros(4)], (8,), {"x": 0.0}, {}, "dict of tensors"),
    ({"x": torch.zeros(4, 2)}, (float("inf"),), {"x": 0.0}, {}, "positive row counts"),
    ({"x": torch.zeros(4, 2), 3: torch.zeros(1)}, (8,), {"y": 0.0}, {}, "does not hold"),
    ({"ids": torch.zeros(4, dtype=torch.uint8)}, (8,), {"ids": -1}, {}, "does not fit"),
    ({"ids": torch.zeros(4, dtype=torch.int64)}, (8,), {"ids": 0.5}, {}, "does not fit"),
    ({"ids": torch.zeros(4, dtype=torch.int32)}, (8,), {"ids": 2**40}, {}, "does not fit"),
    ({"x": torch.zeros(4)}, (8,), {"x": 1e39}, {}, "does not fit"),
    ({"m": torch.zeros(4, dtype=torch.bool)}, (8,), {"m": 2}, {}, "does not fit"),
    ({"x": torch.zeros(4)}, (8,), {"x": 10**400}, {}, "does not fit"),
    ({"x": torch.zeros(4)}, (8,), {"x": 1j}, {}, "does not fit"),
    ({"x": torch.zeros(4)}, (8,), {"x": torch.zeros(2)}, {}, "one number"),
    ({"x": torch.zeros(4, 2), "w": torch.ones(4)}, (8,), {"x": 0.0}, {}, r"\['w'\].*not in fill"),
    ({"x": torch.zeros(4, 2), "pad": torch.zeros(4, dtype=torch.bool, device="meta")}, (8,),
     {"x": 0.0}, {}, "rows' device")])
def test_bad_input_names_the_fix(batch, buckets, fill, kw, match):
    """Each refused with a message naming the fix (a fill a dtype cannot hold would wrap or
    truncate; a same-length entry left out would stay unpadded beside padded ones)."""
    with pytest.raises(ValueError, match=match):
        psf.pad_rows(batch, buckets, fill, **kw)
