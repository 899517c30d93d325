"""`bench router`: what the router options, the load-balancing statistics, a shared expert
and the float8 stash cost one MoE layer, against `psf.moe`'s default router, in one process.

Each variant runs the exact path (`psf.value_and_grad`) and the capacity + stash path
(`run_step`); ratios are to the default router on the same path. ``fp8-stash`` is the default
router with ``stash_precision="fp8"`` (its exact path is the default's); its gradients are
reported against the bf16 stash's, as relative errors ``|g - g_bf16| / |g_bf16|`` (norms).
"""

from __future__ import annotations

import torch

import pagedstash_func as psf

from ._common import DTYPES, cuda_device, device_name, median_seconds, peak_bytes

VARIANTS = ("softmax", "softmax+aux", "sigmoid-groups", "shared-gated", "deepseek", "fp8-stash")


def _variant(name, params, hidden, shared_ffn, experts, gen, dtype, device):
    """``(params, router, aux)`` of one variant (``aux``: a Switch and a z-loss from the
    layer's statistics)."""
    p = dict(params)
    router, aux = psf.Router(), name == "softmax+aux"
    if name in ("sigmoid-groups", "deepseek"):
        router = psf.Router(scores="sigmoid", groups=8, groups_kept=4, scale=2.5,
                            logits_dtype=torch.float32)
        p["router_bias"] = (torch.randn(experts, generator=gen) * 0.01).to(device)
    if name in ("shared-gated", "deepseek"):
        p["shared_gate_up"] = (torch.randn(hidden, 2 * shared_ffn, generator=gen)
                               / hidden ** 0.5).to(device, dtype)
        p["shared_down"] = (torch.randn(shared_ffn, hidden, generator=gen)
                            / shared_ffn ** 0.5).to(device, dtype)
    if name == "shared-gated":
        p["shared_gate"] = (torch.randn(1, hidden, generator=gen) / hidden ** 0.5).to(device,
                                                                                      dtype)
    return p, router, aux


def bench_router(tokens=8192, hidden=2048, ffn=1408, experts=64, top_k=6, capacity_factor=1.25,
                 shared_ffn=2816, iters=10, device=None, dtype_name="bf16", seed=0):
    """Print time and peak of each variant on each path, with ratios to the default router."""
    device = cuda_device(device, "bench router")
    if experts % 8:
        raise ValueError(f"--experts {experts}: the group-limited variants split the experts "
                         f"into 8 groups; pass a multiple of 8")
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    base = psf.moe_init(experts, hidden, ffn, generator=gen, dtype=dtype, device=device)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    cot = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    print(f"device: {device_name(device)}; one layer T={tokens} H={hidden} F={ffn} E={experts} "
          f"k={top_k} {dtype_name}, shared expert F={shared_ffn}; capacity_factor "
          f"{capacity_factor}, fwd+bwd", flush=True)
    rows = {}
    for name in VARIANTS:
        params, router, aux = _variant(name, base, hidden, shared_ffn, experts, gen, dtype,
                                       device)

        def loss_fn(p, b, router=router, aux=aux):
            if aux:
                y, stats = psf.moe(p, b["x"], top_k=top_k, router=router, return_stats=True)
                extra = 1e-2 * psf.switch_loss(stats) + 1e-3 * psf.z_loss(stats)
            else:
                y, extra = psf.moe(p, b["x"], top_k=top_k, router=router), 0.0
            return (y.float() * b["cot"].float()).sum() + extra

        batch = {"x": x, "cot": cot}
        exact = psf.value_and_grad(loss_fn)
        step = psf.stash_aware(loss_fn, psf.StashConfig(
            capacity_factor=capacity_factor, paged_stash=True, expert_ranks=8,
            stash_precision="fp8" if name == "fp8-stash" else "same"))
        box = {"state": step.init(params, batch), "reruns": 0}

        def stashed():
            res = psf.run_step(step, params, batch, box["state"])
            box["state"] = res.state
            box["reruns"] += res.report.reran
            return res.grads

        for path, run in (("exact", lambda: exact(params, batch)), ("capacity+stash", stashed)):
            seconds = median_seconds(run, iters)
            rows[name, path] = (seconds, peak_bytes(run))
        rows[name, "reruns"] = box["reruns"]
        if name in ("softmax", "fp8-stash"):
            rows[name, "grads"] = {k: v.float().clone() for k, v in stashed().items()}
        del step, box
        torch.cuda.empty_cache()
    _report(rows)
    return rows


def _report(rows) -> None:
    """The table of `bench_router`'s ``rows``, the reruns, and the fp8 stash's error."""
    print(f"\n{'variant':<16}{'path':<16}{'ms':>9}{'x softmax':>11}{'peak MiB':>10}"
          f"{'x softmax':>11}")
    for name in VARIANTS:
        for path in ("exact", "capacity+stash"):
            s, peak = rows[name, path]
            s0, peak0 = rows["softmax", path]
            print(f"{name:<16}{path:<16}{s * 1e3:>9.2f}{s / s0:>11.2f}{peak / 2**20:>10.0f}"
                  f"{peak / peak0:>11.2f}")
    print("(peak: what a step adds above the params and inputs, pools counted; reruns: "
          + ", ".join(f"{n} {rows[n, 'reruns']}" for n in VARIANTS) + ")", flush=True)
    ref, got = rows["softmax", "grads"], rows["fp8-stash", "grads"]
    print("fp8 stash, gradient error against the bf16 stash (|g - g_bf16| / |g_bf16|): "
          + ", ".join(f"{k} {float((got[k] - ref[k]).norm() / ref[k].norm()):.2e}"
                      for k in ref), flush=True)
