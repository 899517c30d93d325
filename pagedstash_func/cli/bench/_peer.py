"""`bench peer`: one MoE layer, forward+backward, beside transformers' Mixtral block.

Same weights (`psf.from_hf_moe_block`), same tokens, same loss, one process. For each of
transformers' experts implementations and each of our paths: median time, peak (the most
memory the call adds, its gradients and a step's stash pools included) and the gradient floor
(the bytes of the gradients alone, which no implementation can avoid). Gradients are taken
w.r.t. the tokens and every weight, as for a layer inside a network. Needs the ``interop``
extra (transformers).
"""

from __future__ import annotations

import torch

import pagedstash_func as psf

from ._common import DTYPES, cuda_device, device_name, median_seconds, path_runner, peak_bytes

PEER_IMPLS = ("grouped_mm", "eager", "batched_mm")


def mixtral_block(hidden, ffn, experts, top_k, impl, dtype, device, seed=0):
    """transformers' `MixtralSparseMoeBlock` with ``experts_implementation=impl``."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    config = MixtralConfig(hidden_size=hidden, intermediate_size=ffn, num_local_experts=experts,
                           num_experts_per_tok=top_k, experts_implementation=impl)
    config._experts_implementation = impl
    torch.manual_seed(seed)
    block = MixtralSparseMoeBlock(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        block.gate.weight.normal_(0, hidden ** -0.5)
        block.experts.gate_up_proj.normal_(0, hidden ** -0.5)
        block.experts.down_proj.normal_(0, ffn ** -0.5)
    return block.train()


def peer_runner(block, x, cotangent):
    """``run()``: forward+backward of the transformers block; returns the fresh gradients."""
    x = x.detach().clone().requires_grad_()
    weights = list(block.parameters())

    def run():
        y = block(x.unsqueeze(0))[0]
        (y.float() * cotangent.float()).sum().backward()
        grads = [x.grad, *(p.grad for p in weights)]
        for p in (x, *weights):      # like ours: the caller holds this call's gradients only
            p.grad = None
        return grads
    return run


def ours_loss(top_k, norm_topk_prob=True):
    def loss_fn(params, batch):
        y = psf.moe(params["moe"], params["x"], top_k=top_k, norm_topk_prob=norm_topk_prob)
        return (y.float() * batch["cotangent"].float()).sum()
    return loss_fn


def _measure(name, make_run, iters):
    """``(name, ms, peak MiB, note)``; out-of-memory and unsupported runs become a note."""
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    try:
        run, box = make_run()         # a step's pools are allocated here: counted in the peak
        run()
        peak = peak_bytes(run) + torch.cuda.memory_allocated() - base
        ms = median_seconds(run, iters) * 1e3
    except torch.OutOfMemoryError:
        return name, float("nan"), float("nan"), "out of memory"
    except (RuntimeError, NotImplementedError, KeyError, ImportError) as err:
        return name, float("nan"), float("nan"), f"failed: {str(err).splitlines()[0][:60]}"
    finally:
        torch.cuda.empty_cache()
    note = f"{box['reruns']} reran" if box else ""
    return name, ms, peak / 2**20, note


def bench_peer(tokens=8192, hidden=2048, ffn=1408, experts=64, top_k=6, capacity_factor=1.25,
               iters=10, device=None, dtype_name="bf16", impls=PEER_IMPLS, seed=0):
    """Print and return one row per implementation: time, peak and their ratios to the peer
    (transformers' ``grouped_mm``)."""
    device = cuda_device(device, "bench peer")
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    batch = {"cotangent": torch.randn(tokens, hidden, generator=gen).to(device, dtype)}
    blocks = {impl: mixtral_block(hidden, ffn, experts, top_k, impl, dtype, device, seed)
              for impl in impls}
    params = {"moe": psf.from_hf_moe_block(next(iter(blocks.values()))), "x": x}
    floor = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(params))
    print(f"device: {device_name(device)}; one layer T={tokens} H={hidden} F={ffn} E={experts} "
          f"k={top_k} {dtype_name}, fwd+bwd, grads of x and every weight; capacity_factor "
          f"{capacity_factor}; gradient floor {floor / 2**20:.0f} MiB")
    _check_agreement(blocks, params, top_k)
    loss_fn = ours_loss(top_k)
    rows = [_measure(f"transformers {impl}",
                     lambda impl=impl: (peer_runner(blocks[impl], x, batch["cotangent"]), {}),
                     iters) for impl in impls]
    for name, cfg in (("psf exact", None),
                      ("psf capacity", psf.StashConfig(capacity_factor=capacity_factor)),
                      ("psf capacity+stash", psf.StashConfig(capacity_factor=capacity_factor,
                                                             paged_stash=True))):
        rows.append(_measure(name, lambda cfg=cfg: path_runner(loss_fn, params, batch, cfg),
                             iters))
    _print_rows(rows, floor)
    return rows


def _check_agreement(blocks, params, top_k):
    """Our exact forward against each peer's, at bf16 tolerance (relative norm < 2e-2)."""
    with torch.no_grad():
        ours = psf.moe(params["moe"], params["x"], top_k=top_k).float()
        for impl, block in blocks.items():
            try:
                theirs = block(params["x"].unsqueeze(0))[0].float()
            except (torch.OutOfMemoryError, RuntimeError, NotImplementedError, KeyError):
                continue
            rel = ((ours - theirs).norm() / theirs.norm()).item()
            print(f"outputs agree with transformers {impl}: relative difference {rel:.2e}")
            if not rel < 2e-2:
                raise RuntimeError(f"our layer and transformers {impl} disagree ({rel:.2e})")
            torch.cuda.empty_cache()


def _print_rows(rows, floor):
    ref = next((r for r in rows if r[0] == "transformers grouped_mm" and r[1] == r[1]), None)
    print(f"{'implementation':<26} {'ms':>8} {'x peer':>7} {'peak MiB':>9} {'x peer':>7} "
          f"{'peak/floor':>10}  note")
    for name, ms, peak, note in rows:
        t_ratio = ms / ref[1] if ref else float("nan")
        m_ratio = peak / ref[2] if ref else float("nan")
        print(f"{name:<26} {ms:>8.2f} {t_ratio:>7.2f} {peak:>9.0f} {m_ratio:>7.2f} "
              f"{peak * 2**20 / floor:>10.2f}  {note}")
