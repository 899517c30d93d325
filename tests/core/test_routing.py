"""Router, padding ids and capacity rows against hand-computed cases."""

import pytest
import torch

import pagedstash_func as psf
from pagedstash_func.core._routing import align_rows, canonical_ids, check_ids


@pytest.mark.parametrize("norm", [True, False])
def test_route_is_softmax_topk_in_fp32_at_least(norm):
    g = torch.Generator().manual_seed(0)
    router = torch.randn(5, 8, generator=g).bfloat16()
    x = torch.randn(7, 8, generator=g).bfloat16()
    ids, w = psf.route(router, x, 2, norm)
    probs = torch.softmax((x @ router.T).float(), -1)      # bf16 matmul, fp32 softmax
    want_w, want_ids = probs.topk(2, -1)
    if norm:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert w.dtype == torch.float32 and torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=0, atol=0)
    ids64, w64 = psf.route(router.double(), x.double(), 2, norm)
    assert w64.dtype == torch.float64


def test_padding_ids_become_E_and_bad_ids_are_flagged_not_read():
    ids = torch.tensor([[-1, 0], [4, 3], [-2, 5], [2, 4]])
    canon, bad = canonical_ids(ids, 4)
    assert canon.tolist() == [[4, 0], [4, 3], [4, 4], [2, 4]]
    assert bool(bad)
    _, fine = canonical_ids(ids.clamp(-1, 4), 4)
    assert not bool(fine)


def test_check_ids_names_the_first_bad_id_and_its_position():
    ids = torch.tensor([[0, 1], [2, 9], [-3, 0]])
    with pytest.raises(ValueError, match=r"routing id 9 at position \(1, 1\) is outside "
                                         r"\[-1, 4\]"):
        check_ids(ids, 4)
    check_ids(torch.tensor([[-1, 4]]), 4)          # both padding spellings are fine


@pytest.mark.parametrize("tokens, k, cf, ranks, budget, rows", [
    (24, 2, 1.0, 2, 32, 48),      # ceil(1.0 * 48 / 2) = 24 -> 32; rows min(64, align(48))
    (24, 2, 2.0, 2, 48, 48),      # want 48, capped at T*k = 48
    (10, 3, 1.25, 4, 16, 32),     # ceil(1.25 * 30 / 4) = 10 -> 16; rows min(64, align(30))
    (100, 1, 1.1, 1, 112, 112),   # ceil(110) capped at 100 -> 112
    (0, 2, 1.5, 2, 0, 0),         # zero tokens: empty buffers
])
def test_capacity_rows_hand_computed(tokens, k, cf, ranks, budget, rows):
    cfg = psf.StashConfig(capacity_factor=cf, expert_ranks=ranks)
    cap = psf.capacity_rows(tokens, k, cfg)
    assert (cap.budget, cap.rows) == (budget, rows)
    assert align_rows(cap.budget) == cap.budget and align_rows(17) == 32
