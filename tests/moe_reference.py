"""An independent, slow MoE reference: loops over tokens and slots, no buffers, no sorting."""

import torch


def reference_routing(router, x, top_k, norm_topk_prob=True):
    probs = torch.softmax((x @ router.T).double(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def reference_moe(params, x, ids, weights, keep=None):
    """``sum_s w[t,s] * expert_{ids[t,s]}(x[t])`` over non-padding pairs (and ``keep`` mask)."""
    num_experts = params["w_gate_up"].shape[0]
    ffn = params["w_down"].shape[1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            if e < 0 or e >= num_experts or (keep is not None and not keep[t, s]):
                continue
            gu = x[t] @ params["w_gate_up"][e]
            act = torch.nn.functional.silu(gu[:ffn]) * gu[ffn:]
            out[t] = out[t] + weights[t, s].to(x.dtype) * (act @ params["w_down"][e])
    return out


def two_rank_ids(tokens, experts, share, generator):
    """``[tokens, 2]`` routing ids of two distinct experts on one rank of two: a token's
    pair lands on the first rank's experts (the first half) with probability ``share``, so
    that rank carries about ``2 * share`` times the balanced load."""
    half = experts // 2
    first = torch.rand(tokens, generator=generator) < share
    base = torch.where(first, torch.randint(0, half, (tokens,), generator=generator),
                       torch.randint(half, experts, (tokens,), generator=generator))
    return torch.stack([base, (base + 1) % half + (base // half) * half], 1)


def two_rank_report(ratios, pairs, over=False):
    """A `StepReport` of ``pairs`` routed pairs a layer whose layer ``i``'s busier of two
    ranks carries ``ratios[i]`` (in [1, 2]) times the balanced load (``pairs / 2``)."""
    import pagedstash_func as psf
    half, layers = pairs // 2, []
    for i, ratio in enumerate(ratios):
        hi = round(ratio * half)
        layers.append(psf.LayerReport(f"moe{i}", (hi, pairs - hi), (hi, pairs - hi),
                                      rows=pairs, balanced_rows=pairs, budget=half,
                                      capacity=pairs))
    return psf.StepReport(over, over, False, False, tuple(layers), {}, {}, 0, 0)
