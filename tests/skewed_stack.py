"""A stack of MoE layers whose routing a batch can skew (a per-expert bias on the router's
scores), for the step's tests: enough skew drops pairs and forces a rerun."""

import torch

import pagedstash_func as psf

E, H, F, K, T = 8, 16, 24, 2, 48


def make(seed=0, layers=2, dtype=torch.float32):
    """``(params, batch)``: ``layers`` MoE layers, ``T`` tokens, no skew yet."""
    g = torch.Generator().manual_seed(seed)
    params = [psf.moe_init(E, H, F, generator=g, dtype=dtype) for _ in range(layers)]
    batch = {"x": torch.randn(T, H, generator=g, dtype=dtype),
             "skew": torch.zeros(E, dtype=dtype)}
    return params, batch


def loss_fn(params, batch):
    """Routing from each layer's router plus the batch's per-expert ``skew``."""
    x = batch["x"]
    for p in params:
        h = torch.tanh(x)
        probs = torch.softmax(h @ p["router"].T + batch["skew"], -1)
        w, ids = probs.topk(K, -1)
        x = x + psf.moe(p, h, top_k=K, routing=(ids, w / w.sum(-1, keepdim=True)))
    return (x ** 2).mean(), {"mean": x.mean()}
