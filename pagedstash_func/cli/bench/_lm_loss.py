"""`bench lm-loss`: the LM head and its cross-entropy, forward and backward, at a model's widths.

Three ways in one process, the same bf16 hidden states, head weight and targets:
``full`` (what transformers does: the whole ``[N, V]`` logits, cast to fp32, torch's
cross-entropy, autograd's backward), ``chunked-torch`` (`psf.lm_loss` with each chunk's loss
and gradient by the torch twin) and ``chunked-triton`` (the same with the Triton kernel, what
``backend="auto"`` runs on CUDA). Per way: median ms, x full, TFLOP/s of the head's three
GEMMs (6 N V H), the peak it adds, and how far its loss and gradients are from full's.
Then one chunk's cross-entropy alone (`psf.kernels.cross_entropy_rows`, twin and kernel):
ms and the GB/s of the bytes each must move at least (the logits read, the gradient written).
"""

from __future__ import annotations

import torch

import pagedstash_func as psf

from ._common import cuda_device, device_name, median_seconds, peak_bytes
from ._train import shape_of

WAYS = ("full", "chunked-torch", "chunked-triton")


def _inputs(n: int, h: int, v: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, device=device).to(torch.bfloat16)
    weight = (torch.randn(v, h, generator=g, device=device) * h ** -0.5).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    targets[::97] = -100                       # a few positions predict nothing
    return hidden, weight, targets


def _way(way: str, hidden, weight, targets, chunk):
    """``run()``: one forward and backward of ``way``, returning (loss, d hidden, d weight)."""
    def run():
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        if way == "full":
            logits = h @ w.T
            loss = torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=-100)
        else:
            loss = psf.lm_loss(h, w, targets, chunk, backend=way.split("-")[1])
        loss.backward()
        return loss.detach(), h.grad, w.grad
    return run


def bench_lm_loss(model: str = "qwen3_moe", tokens: int | None = None, chunk: int | None = None,
                  iters: int = 10, warmup: int = 3, device=None) -> dict:
    """Print one row per way and one per backend of a chunk; see the module docstring.

    Returns:
        ``{way: {"s", "peak", "loss_err", "grad_err"}}`` and ``{"rows-torch" / "rows-triton":
        {"s", "gbs"}}`` for one chunk.
    """
    shape = shape_of(model, tokens=tokens, seq=tokens)     # (rows: no sequences here)
    device = cuda_device(device, "bench lm-loss")
    n, h, v = shape.tokens, shape.hidden, shape.vocab
    one = min(n, chunk or max(256, (1 << 27) // v))   # psf.lm_loss's default, timed alone
    print(f"bench lm-loss --model {shape.model}: N={n} tokens, H={h}, V={v}, chunks of "
          f"{one} rows, bf16; {device_name(device)}; torch {torch.__version__}", flush=True)
    hidden, weight, targets = _inputs(n, h, v, device)
    rows, ref = {}, None
    for way in WAYS:
        run = _way(way, hidden, weight, targets, chunk)
        out = run()                                          # compiles the kernel, if any
        if ref is None:
            ref = out
        peak = peak_bytes(run)
        rows[way] = {"s": median_seconds(run, iters, warmup), "peak": peak,
                     "loss_err": abs(float(out[0]) - float(ref[0])),
                     "grad_err": max(float((a.float() - b.float()).abs().max())
                                     for a, b in zip(out[1:], ref[1:]))}
        del run, out
    flops = 6 * n * v * h
    base = rows["full"]["s"]
    print(f"\n{'way':<16}{'ms':>9}{'x full':>8}{'TFLOP/s':>9}{'peak MiB':>10}"
          f"{'|loss - full|':>15}{'max |grad - full|':>19}")
    for way, r in rows.items():
        print(f"{way:<16}{r['s'] * 1e3:>9.2f}{base / r['s']:>8.2f}{flops / r['s'] / 1e12:>9.0f}"
              f"{r['peak'] / 2**20:>10.0f}{r['loss_err']:>15.2e}{r['grad_err']:>19.2e}")
    logits = hidden[:one] @ weight.T
    scale = torch.tensor(1.0 / n, device=device)
    moved = 2 * logits.numel() * logits.element_size()      # read once, written once
    print(f"\none chunk's cross-entropy ({logits.shape[0]} x {v}; at least {moved / 1e9:.2f} GB "
          f"moved):")
    for backend in ("torch", "triton"):
        s = median_seconds(lambda b=backend: psf.kernels.cross_entropy_rows(
            logits, targets[:one], scale, b), iters, warmup)
        rows[f"rows-{backend}"] = {"s": s, "gbs": moved / s / 1e9}
        print(f"  {backend:<8}{s * 1e3:>9.3f} ms{moved / s / 1e9:>9.0f} GB/s", flush=True)
    print(f"  kernel x twin: {rows['rows-torch']['s'] / rows['rows-triton']['s']:.2f}",
          flush=True)
    return rows
