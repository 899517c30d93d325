"""The main job: train a tiny MoE character model on a text shipped with the package.

``python -m pagedstash_func demo`` runs it on the CPU; ``--device cuda`` on a GPU. Every step
goes through `run_step`: capacity path first, one flag read, a dropless rerun when needed.
"""

from __future__ import annotations

import importlib.resources
import math
import time

import torch
import torch.utils._pytree as pytree

import pagedstash_func as psf


def corpus() -> str:
    return importlib.resources.files("pagedstash_func").joinpath("data/corpus.txt").read_text()


def init_model(vocab: int, *, hidden=64, ffn=96, experts=8, layers=2, seq=32, seed=0,
               device="cpu") -> dict:
    """Embedding, position table, ``layers`` MoE blocks and an output head (a dict pytree)."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(device)

    return {"embed": normal(vocab, hidden, std=0.5), "pos": normal(seq, hidden, std=0.1),
            "blocks": [psf.moe_init(experts, hidden, ffn, generator=g, device=device)
                       for _ in range(layers)],
            "head": normal(hidden, vocab, std=hidden ** -0.5)}


def rms_norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def forward(params, tokens, padding, top_k=2):
    """``tokens [B, S]`` -> logits ``[B, S, V]``; a causal running mean mixes positions.

    Positions where ``padding [B, S]`` is true are routed to padding id ``-1``: they reach no
    expert, take no capacity and no pages.
    """
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    steps = torch.arange(1, tokens.shape[1] + 1, device=x.device, dtype=x.dtype)
    pad = padding.reshape(-1, 1)
    for block in params["blocks"]:
        h = rms_norm(x)
        h = h + h.cumsum(1) / steps[:, None]
        ids, weights = psf.route(block["router"], h.reshape(-1, h.shape[-1]), top_k)
        ids = torch.where(pad, -1, ids)
        x = x + psf.moe(block, h, top_k=top_k, routing=(ids, weights))
    return rms_norm(x) @ params["head"]


def loss_fn(params, batch):
    """Next-character cross-entropy over real positions; aux is the accuracy (tensors only)."""
    tokens, padding = batch["tokens"], batch["padding"]
    logits = forward(params, tokens[:, :-1], padding[:, :-1])
    targets = torch.where(padding[:, 1:], -100, tokens[:, 1:])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1), ignore_index=-100)
    real = targets != -100
    accuracy = ((logits.argmax(-1) == targets) & real).sum() / real.sum()
    return loss, {"accuracy": accuracy}


def make_batch(data: torch.Tensor, step: int, *, batch_size: int, seq: int, seed: int):
    """Windows of ``seq + 1`` characters, each cut to a random length in ``[seq/2, seq+1]``
    and padded, drawn with a generator seeded by (seed, step): a packed batch in miniature."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq - 1, (batch_size,), generator=g)
    lengths = torch.randint(seq // 2, seq + 2, (batch_size,), generator=g)
    padding = torch.arange(seq + 1)[None, :] >= lengths[:, None]
    tokens = torch.stack([data[s: s + seq + 1] for s in starts.tolist()])
    return {"tokens": torch.where(padding, 0, tokens), "padding": padding}


def adam(params, grads, moments, step, lr=3e-3, betas=(0.9, 0.99), eps=1e-8):
    """One Adam update as a pure function of pytrees: ``(params, moments)`` out."""
    m, v = moments
    m = pytree.tree_map(lambda m_, g: betas[0] * m_ + (1 - betas[0]) * g, m, grads)
    v = pytree.tree_map(lambda v_, g: betas[1] * v_ + (1 - betas[1]) * g * g, v, grads)
    c1, c2 = 1 - betas[0] ** step, 1 - betas[1] ** step
    params = pytree.tree_map(lambda p, m_, v_: p - lr * (m_ / c1) / ((v_ / c2).sqrt() + eps),
                             params, m, v)
    return params, (m, v)


def train(steps=60, *, device="cpu", capacity_factor=1.1, expert_ranks=2, paged_stash=True,
          cuda_factor=0.9, host_factor=0.0, batch_size=16, seq=32, seed=0, progress=True,
          print_fn=print) -> dict:
    """Train and return a summary (losses, reruns and reasons, pages, stash bytes, time)."""
    from tqdm.auto import tqdm
    text = corpus()
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text])
    params = init_model(len(vocab), seq=seq, seed=seed, device=device)
    cfg = psf.StashConfig(capacity_factor=capacity_factor, paged_stash=paged_stash,
                      expert_ranks=expert_ranks, cuda_factor=cuda_factor,
                      host_factor=host_factor)
    step = psf.stash_aware(loss_fn, cfg)

    def batch_at(i):
        return {k: v.to(device) for k, v in make_batch(data, i, batch_size=batch_size,
                                                        seq=seq, seed=seed).items()}

    state = step.init(params, batch_at(0))
    moments = (pytree.tree_map(torch.zeros_like, params),) * 2   # adam never writes in place
    losses, reasons, pages_peak, stash_bytes, padded_bytes = [], {}, {}, 0, 0
    reruns = 0
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="train", disable=not progress, leave=False)
    for i in bar:
        res = psf.run_step(step, params, batch_at(i), state)
        state = res.state
        params, moments = adam(params, res.grads, moments, i + 1)
        losses.append(float(res.loss))
        if res.report.reran:
            reruns += 1
            for r in res.report.reasons:
                reasons[r] = reasons.get(r, 0) + 1
        for pool, need in res.report.pages_needed.items():
            pages_peak[pool] = max(pages_peak.get(pool, 0), need)
        stash_bytes = max(stash_bytes, res.report.stash_bytes)
        padded_bytes = max(padded_bytes, res.report.padded_bytes)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", reruns=reruns)
        if not progress and (i % max(1, steps // 10) == 0 or i == steps - 1):
            print_fn(f"step {i:>4}  loss {losses[-1]:.3f}  reruns so far {reruns}")
    seconds = time.perf_counter() - start
    available = {lay: res.report.pages_available[lay] for lay in pages_peak}
    return {"losses": losses, "reruns": reruns, "reasons": reasons, "steps": steps,
            "pages_peak": pages_peak, "pages_available": available,
            "stash_bytes": stash_bytes, "padded_bytes": padded_bytes, "seconds": seconds,
            "config": cfg}


def run_demo(steps=60, device=None, capacity_factor=1.1, expert_ranks=2, paged_stash=True,
             cuda_factor=0.9, host_factor=0.0, seed=0, progress=True) -> dict:
    """`train`, then print what happened."""
    device = device or "cpu"
    print(f"training a tiny MoE character model for {steps} steps on {device} "
          f"(capacity_factor={capacity_factor}, expert_ranks={expert_ranks}, "
          f"paged_stash={paged_stash}, cuda_factor={cuda_factor}, host_factor={host_factor})")
    out = train(steps, device=device, capacity_factor=capacity_factor,
                expert_ranks=expert_ranks, paged_stash=paged_stash, cuda_factor=cuda_factor,
                host_factor=host_factor, seed=seed, progress=progress)
    losses = out["losses"]
    marks = sorted({0, len(losses) // 4, len(losses) // 2, 3 * len(losses) // 4,
                    len(losses) - 1})
    print("loss:  " + "  ".join(f"step {i}: {losses[i]:.3f}" for i in marks))
    why = ", ".join(f"{k} x{v}" for k, v in out["reasons"].items()) or "none"
    print(f"reruns: {out['reruns']} of {steps} steps ({out['reruns'] / steps:.0%}); "
          f"reasons: {why}")
    if out["pages_peak"]:
        peak = ", ".join(f"{pool}: {need} of {out['pages_available'][pool][0]} device"
                         f" + {out['pages_available'][pool][1]} host"
                         for pool, need in out["pages_peak"].items())
        print(f"pages at peak: {peak}")
        print(f"stash at peak {out['stash_bytes'] / 2**10:.0f} KiB in pages against "
              f"{out['padded_bytes'] / 2**10:.0f} KiB of capacity-padded buffers "
              f"({1 - out['stash_bytes'] / out['padded_bytes']:.0%} saved)")
    print(f"wall time {out['seconds']:.1f} s ({out['seconds'] / steps * 1e3:.0f} ms/step)")
    if not math.isfinite(losses[-1]):
        raise RuntimeError("training diverged")
    return out
