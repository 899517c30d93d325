"""`bench train`: a whole transformers MoE model, trained a step at a time, beside itself.

transformers' own model (``experts_implementation="grouped_mm"``, sdpa attention,
``.backward()``) and the same model through `psf.from_hf_model` on each psf path, same weights,
same batch, one process. When transformers' path runs beside psf's, two copies of the weights
are held (transformers' model in its own layout, and the copy psf adopts); each path's peak is
measured over what was allocated before it started (its state's pools included), so neither
copy counts in the other's figure. With an optimizer, every psf path starts from the same
weights (they are put back before each path; the copy kept for that is held outside every
path's peak).

Per path: median step time, tokens/s, MFU (model FLOPs over the H100/H200 datasheet's dense
bf16 rate, 989 TFLOP/s), peak and held memory, reruns, and the loss beside transformers'.
``--optimizer adamw`` adds an AdamW step on fp32 master weights and moments (their memory
counts in the peak); ``adamw-offload`` keeps those in host memory and steps them there;
``adamw8bit`` is torchao's AdamW8bit (8-bit moments on the GPU), if torchao is installed.
``--plan`` prints `psf.plan_memory`'s predicted peak beside each psf path's measured absolute
peak (run it without the transformers path, whose weights would count in psf's).
``--max-tokens`` finds, for each path, the most micro-batches of ``--seq`` tokens that fit on
the GPU, each size probed in a fresh process.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.utils._pytree as pytree

import pagedstash_func as psf

from ._common import (
    KERNEL_KINDS,
    cuda_device,
    device_name,
    event_seconds,
    largest_fitting,
    print_profile,
)

PEAK_FLOPS = 989.4e12    # dense bf16, H100/H200 SXM datasheet
MODELS = {               # the shapes of the figures (layers may be cut with --layers)
    "olmoe": dict(layers=16, hidden=2048, experts=64, ffn=1024, top_k=8, vocab=50304,
                  heads=16, kv_heads=16, head_dim=128, tokens=16384, seq=4096),
    "qwen3_moe": dict(layers=8, hidden=2048, experts=128, ffn=768, top_k=8, vocab=151936,
                      heads=32, kv_heads=4, head_dim=128, tokens=8192, seq=4096),
    "mixtral": dict(layers=4, hidden=4096, experts=8, ffn=14336, top_k=2, vocab=32000,
                    heads=32, kv_heads=8, head_dim=128, tokens=8192, seq=4096),
    # Qwen1.5-MoE-A2.7B widths: a shared expert of 5632 gated per token
    "qwen2_moe": dict(layers=8, hidden=2048, experts=60, ffn=1408, top_k=4, vocab=151936,
                      heads=16, kv_heads=16, head_dim=128, tokens=8192, seq=4096,
                      shared_ffn=5632),
    # Moonlight-16B-A3B widths (the DeepSeek-V3 architecture: MLA attention, sigmoid router
    # with a score-correction bias, 2 shared experts, a first dense layer), routed with
    # DeepSeek-V3's group limit (8 groups of 8 experts, 4 kept)
    "deepseek_v3": dict(layers=8, hidden=2048, experts=64, ffn=1408, top_k=6, vocab=163840,
                        heads=16, kv_heads=16, head_dim=128, tokens=8192, seq=4096,
                        shared_ffn=2816, dense_layers=1, dense_ffn=11264, groups=8,
                        groups_kept=4),
}
PATHS = ("transformers", "exact", "capacity", "stash", "stash-layer", "checkpoint", "fp8",
         "graphed", "func", "compiled", "compiled-graphed")
DEFAULT_PATHS = ("transformers", "exact", "capacity", "stash", "stash-layer", "graphed")
# "checkpoint": stash-layer with from_hf_model's checkpoint_attention; "fp8": stash-layer with
# stash_precision="fp8" (lossy, reported beside the others); "compiled": stash-layer as a
# psf.compile step, "compiled-graphed" that step captured by psf.graphed (the first step of
# each, which compiles, reported beside the table)


@dataclasses.dataclass(frozen=True)
class Shape:
    model: str
    layers: int
    hidden: int
    experts: int
    ffn: int
    top_k: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tokens: int
    seq: int
    shared_ffn: int = 0       # a shared expert's width (0: none)
    dense_layers: int = 0     # first layers with a dense MLP instead (DeepSeek-V3)
    dense_ffn: int = 0
    groups: int = 1           # group-limited routing (DeepSeek-V3)
    groups_kept: int = 1

    @property
    def batch(self) -> int:
        return self.tokens // self.seq

    def flops_per_token(self) -> float:
        """6 x (active non-embedding parameters + LM head) + causal attention's 6 L S d."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        if self.model == "deepseek_v3":       # MLA: q, kv down / up (rank 512), out
            attn = self.hidden * self.heads * 192 + self.hidden * 576 \
                + 512 * self.heads * 256 + self.heads * 128 * self.hidden
        experts = 3 * self.hidden * (self.ffn * self.top_k + self.shared_ffn)
        moe_layers = self.layers - self.dense_layers
        dense = self.layers * attn + moe_layers * (experts + self.hidden * self.experts) \
            + self.dense_layers * 3 * self.hidden * self.dense_ffn
        return 6 * (dense + self.vocab * self.hidden) \
            + 6 * self.layers * self.seq * self.heads * self.head_dim


def shape_of(model: str, **overrides) -> Shape:
    if model not in MODELS:
        raise ValueError(f"--model {model!r}: choose one of {', '.join(MODELS)}")
    fields = {f.name for f in dataclasses.fields(Shape)} - {"model"}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ValueError(f"--shape {','.join(bad)}: not a width of the model; choose from "
                         f"{', '.join(sorted(fields))}")
    values = {**MODELS[model], **{k: v for k, v in overrides.items() if v is not None}}
    shape = Shape(model=model, **values)
    _check_widths(shape)
    if shape.tokens % shape.seq:
        raise ValueError(f"--tokens {shape.tokens} is not a multiple of --seq {shape.seq}: a "
                         f"step is micro-batches of --seq tokens")
    return shape


def _check_widths(shape: Shape) -> None:
    """`ValueError` for widths the model cannot take together (from ``--shape``)."""
    if shape.heads % shape.kv_heads:
        raise ValueError(f"--shape: heads={shape.heads} must be a multiple of "
                         f"kv_heads={shape.kv_heads}")
    if not 1 <= shape.top_k <= shape.experts:
        raise ValueError(f"--shape: top_k={shape.top_k} must be between 1 and "
                         f"experts={shape.experts}")
    if shape.experts % shape.groups or not 1 <= shape.groups_kept <= shape.groups \
            or (shape.groups > 1 and shape.experts // shape.groups < 2):
        raise ValueError(f"--shape: experts={shape.experts} in groups={shape.groups} of at "
                         f"least 2 experts each, groups_kept={shape.groups_kept} of them: "
                         f"pick groups dividing the experts and groups_kept <= groups")
    if shape.model == "deepseek_v3" and shape.kv_heads != shape.heads:
        raise ValueError(f"--shape: DeepSeek-V3's attention has as many key-value heads as "
                         f"heads; give kv_heads={shape.heads}")
    if shape.dense_layers >= shape.layers and shape.dense_layers:
        raise ValueError(f"--shape: dense_layers={shape.dense_layers} leaves no sparse layer "
                         f"of {shape.layers}")


def hf_config(shape: Shape):
    """The transformers config of ``shape`` (grouped_mm experts, sdpa attention)."""
    import transformers
    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                  num_key_value_heads=shape.kv_heads, num_experts_per_tok=shape.top_k,
                  max_position_embeddings=max(4096, shape.seq), attn_implementation="sdpa",
                  experts_implementation="grouped_mm", tie_word_embeddings=False)
    if shape.model == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=shape.ffn, num_experts=shape.experts,
                                       **common)
    elif shape.model == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=shape.ffn,
                                          num_experts=shape.experts, head_dim=shape.head_dim,
                                          intermediate_size=4 * shape.ffn, **common)
    elif shape.model == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(moe_intermediate_size=shape.ffn,
                                          num_experts=shape.experts,
                                          shared_expert_intermediate_size=shape.shared_ffn,
                                          intermediate_size=4 * shape.ffn, **common)
    elif shape.model == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            moe_intermediate_size=shape.ffn, n_routed_experts=shape.experts,
            n_shared_experts=shape.shared_ffn // shape.ffn, intermediate_size=shape.dense_ffn,
            first_k_dense_replace=shape.dense_layers, n_group=shape.groups,
            topk_group=shape.groups_kept, routed_scaling_factor=2.446, q_lora_rank=None,
            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
            **common)
    else:
        cfg = transformers.MixtralConfig(intermediate_size=shape.ffn,
                                         num_local_experts=shape.experts, **common)
    cfg._experts_implementation = "grouped_mm"
    return cfg


def build(shape: Shape, device, seed: int = 0):
    """transformers' model of ``shape`` in bf16 on ``device``, random weights (seeded)."""
    import transformers
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config(shape), dtype=torch.bfloat16, attn_implementation="sdpa",
            experts_implementation="grouped_mm")
    return model.train()


def make_batch(shape: Shape, device, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g, device=device)
    return {"input_ids": ids, "labels": ids.clone()}


OPTIMIZERS = (None, "adamw", "adamw-offload", "adamw8bit")
_PLANNED = {None: None, "adamw": "adamw", "adamw-offload": "adamw", "adamw8bit": "adamw8bit"}
_OPTIMIZER_WORDS = {None: "", "adamw": ", AdamW (fp32 master + moments)",
                    "adamw-offload": ", AdamW (fp32 master + moments in host memory)",
                    "adamw8bit": ", torchao AdamW8bit (fp32 master, 8-bit moments)"}


def adamw(weights, group=None, kind="adamw"):
    """The library's optimizer, as a training loop makes it: ``torch.optim.AdamW`` (fused on
    CUDA, and on the host when offloaded) over fp32 master weights of the bf16 ``weights``,
    stepped in buckets of flat pieces (`psf.sharded_optimizer`: sharded over ``group``, or
    nothing to shard over). ``kind``: ``"adamw"``, ``"adamw-offload"`` (the state in host
    memory) or ``"adamw8bit"`` (torchao's AdamW8bit: 8-bit moments)."""
    if kind == "adamw8bit":
        try:
            from torchao.optim import AdamW8bit
        except ImportError as err:
            raise ValueError("--optimizer adamw8bit needs torchao: pip install torchao") \
                from err
        return psf.sharded_optimizer(weights, group, AdamW8bit, lr=1e-5, weight_decay=0.01)
    fused = {"fused": True} if pytree.tree_leaves(weights)[0].is_cuda else {}
    return psf.sharded_optimizer(weights, group, torch.optim.AdamW, lr=1e-5,
                                 weight_decay=0.01, offload=kind == "adamw-offload", **fused)


class Split:
    """A step in its two parts, the gradients and the optimizer's step over ``leaves``, with
    CUDA events around each (`step`), and (offloaded) the optimizer's own breakdown; `read`
    between steps."""

    def __init__(self, opt, leaves):
        self.opt, self.leaves, self.events = opt, leaves, None

    def step(self, gradients):
        """``gradients()`` gives ``(grads of the leaves, loss, reran)``; the optimizer steps
        them; returns ``(loss, reran)``. The last event is recorded on the caller's stream,
        which the offloaded step made wait for its last copy: the moment the next forward
        may start."""
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        self.events[0].record()
        grads, loss, reran = gradients()
        self.events[1].record()
        if self.opt is not None:
            self.opt.step(self.leaves, grads)
        self.events[2].record()
        return loss, reran

    def read(self) -> dict:
        """Seconds: ``grads`` (forward and backward), ``optimizer`` (its step on the device's
        clock, until the next forward may start), and ``host_*`` from `offload_times`."""
        first, grads, done = self.events
        done.synchronize()
        out = {"grads": first.elapsed_time(grads) / 1e3,
               "optimizer": grads.elapsed_time(done) / 1e3}
        if self.opt is not None and self.opt.offloaded:
            out.update({f"host_{k}": v for k, v in self.opt.offload_times().items()})
        return out


def hf_runner(model, batch, optimizer):
    weights = list(model.parameters())
    split = Split(adamw(weights, kind=optimizer) if optimizer else None, weights)

    def gradients():
        loss = model(**batch).loss
        loss.backward()
        grads = [p.grad for p in weights]
        for p in weights:          # the list holds them through the optimizer's step
            p.grad = None
        return grads, loss.detach(), 0
    return (lambda: split.step(gradients)), None, split


def psf_runner(path: str, params, loss_fn, batch, cf: float, optimizer):
    leaves = pytree.tree_leaves(params)
    split = Split(adamw(leaves, kind=optimizer) if optimizer else None, leaves)
    if path == "func":
        grad = torch.func.grad_and_value(loss_fn, has_aux=True)

        def gradients():
            grads, (loss, _) = grad(params, batch)
            return pytree.tree_leaves(grads), loss, 0
        return (lambda: split.step(gradients)), None, split
    stepper, box = path_stepper(path, params, loss_fn, batch, cf)

    def stepped():
        res = stepper(params, batch, box["state"])
        box["state"] = res.state
        return pytree.tree_leaves(res.grads), res.loss, int(res.report.reran)
    return (lambda: split.step(stepped)), box, split


def path_config(path: str, cf: float) -> psf.StashConfig:
    """The `StashConfig` of a psf path."""
    if path == "exact":
        return psf.StashConfig()
    return psf.StashConfig(
        capacity_factor=cf, paged_stash=path != "capacity",
        pool_scope="layer" if path in ("stash-layer", "checkpoint", "fp8", "compiled",
                                       "compiled-graphed")
        else "state",
        stash_precision="fp8" if path == "fp8" else "same")


def path_stepper(path: str, params, loss_fn, batch, cf: float):
    """``(stepper, box)`` of a psf path: ``stepper(params, batch, state)`` is `run_step` (or
    `psf.graphed`) of the path's `stash_aware` step, ``box["state"]`` its state."""
    cfg = path_config(path, cf)
    if path == "checkpoint":          # stash-layer with the attention blocks recomputed
        loss_fn = copy.copy(loss_fn)
        loss_fn.checkpoint_attention = True
    step = psf.stash_aware(loss_fn, cfg)
    step = psf.compile(step) if path.startswith("compiled") else step
    box = {"state": step.init(params, batch)}
    stepper = psf.graphed(step, donate=True, copy_grads=False) if path.endswith("graphed") \
        else (lambda *a: psf.run_step(step, *a))
    return stepper, box


def measure(run, iters: int, warmup: int, split: Split | None = None) -> dict:
    """Median step seconds, reruns, last loss, the first step's seconds, and with ``split``
    the median of each of its parts (read after each timed step, outside its time)."""
    reruns, first = 0, None
    for _ in range(warmup):
        start = time.perf_counter()
        loss, rr = run()
        if first is None:
            torch.cuda.synchronize()
            first = time.perf_counter() - start
        reruns += rr
    times, parts = [], []
    for _ in range(iters):
        out = {}
        times.append(event_seconds(lambda: out.setdefault("r", run())))
        loss, rr = out["r"]
        reruns += rr
        if split is not None:
            parts.append(split.read())
    torch.cuda.synchronize()
    median = {k: statistics.median(p[k] for p in parts) for k in parts[0]} if parts else None
    return {"s": statistics.median(times), "reruns": reruns, "loss": float(loss),
            "steps": warmup + iters, "first_s": first, "split": median}


def run_path(path, shape, model_hf, psf_model, batch, cf, iters, warmup, optimizer,
             profile=False):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if path == "transformers":
        run, box, split = hf_runner(model_hf, batch, optimizer)
    else:
        params, loss_fn = psf_model
        run, box, split = psf_runner(path, params, loss_fn, batch, cf, optimizer)
    out = measure(run, iters, warmup, split if optimizer else None)
    out["peak"] = torch.cuda.max_memory_allocated() - base
    out["absolute"] = torch.cuda.max_memory_allocated()
    out["held"] = torch.cuda.memory_allocated() - base
    out["reserved"] = torch.cuda.memory_reserved()
    if split.opt is not None:
        out["state_bytes"] = split.opt.state_bytes()
        out["pinned_bytes"] = split.opt.pinned_bytes()
        out["offloaded"] = split.opt.offloaded
    if profile:
        out["kinds"] = print_profile(path, run, rows=25)
    del run, box, split
    return out


def bench_train(model="olmoe", layers=None, tokens=None, seq=None, paths=DEFAULT_PATHS,
                capacity_factor=1.25, iters=5, warmup=2, optimizer=None, max_tokens=False,
                device=None, seed=0, probe=None, loss_chunk=0, profile=False,
                shape_overrides=None, plan=False):
    """Print one row per path; see the module docstring."""
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise ValueError(f"--paths {','.join(paths)}: choose from {', '.join(PATHS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer {optimizer!r}: choose adamw, adamw-offload or "
                         f"adamw8bit")
    if plan and "transformers" in paths and len(paths) > 1:
        raise ValueError("--plan compares each psf path's absolute peak with its plan: run "
                         "it without the transformers path, whose copy of the weights would "
                         "count in psf's peaks")
    shape = shape_of(model, layers=layers, tokens=tokens, seq=seq, **(shape_overrides or {}))
    device = cuda_device(device, "bench train")
    if max_tokens:
        return _max_tokens(shape, paths, capacity_factor, optimizer, device, loss_chunk)
    print(f"bench train --model {shape.model}: {shape.layers} layers, H {shape.hidden}, "
          f"{shape.experts} experts x {shape.ffn}, top-{shape.top_k}, vocab {shape.vocab}, "
          f"T={shape.tokens} ({shape.batch} x {shape.seq}), bf16, "
          f"cf {capacity_factor}{_OPTIMIZER_WORDS[optimizer]}, "
          f"psf LM loss {'transformers' if loss_chunk < 0 else 'chunked'}; "
          f"{device_name(device)}; torch {torch.__version__}", flush=True)
    model_hf = build(shape, device, seed)
    batch = make_batch(shape, device, seed)
    psf_model = None
    if any(p != "transformers" for p in paths):
        # the second copy (see above), unless transformers' path is not run: then psf adopts
        # the model itself and one copy is held, as in training
        own = model_hf if "transformers" not in paths else copy.deepcopy(model_hf)
        psf_model = psf.from_hf_model(own, loss_chunk=None if loss_chunk < 0 else loss_chunk)
    rows = {}
    start = None
    if optimizer and sum(p != "transformers" for p in paths) > 1:
        # on the host: a copy on the device would count in every path's absolute peak
        start = [t.detach().to("cpu", copy=True) for t in pytree.tree_leaves(psf_model[0])]
    for path in paths:
        print(f"  {path} ...", flush=True)
        if start is not None and path != "transformers":
            with torch.no_grad():
                for t, s in zip(pytree.tree_leaves(psf_model[0]), start):
                    t.copy_(s)
        try:
            rows[path] = run_path(path, shape, model_hf, psf_model, batch, capacity_factor,
                                  iters, warmup, optimizer, profile)
        except torch.OutOfMemoryError:
            rows[path] = None
            torch.cuda.empty_cache()
        if probe is not None:
            print(json.dumps({"path": path, "ok": rows[path] is not None, **(rows[path] or {})}),
                  flush=True)
    if probe is None:
        _table(shape, rows)
    if plan:
        _plan_rows(shape, rows, capacity_factor, optimizer, model_hf.config)
    return rows


def _plan_rows(shape, rows, cf, optimizer, config):
    """Each psf path's measured absolute peak beside `psf.plan_memory`'s, and the plan."""
    print(f"\n{'path':<14}{'plan GiB':>10}{'measured GiB':>14}{'plan/measured':>15}"
          f"{'at':>11}")
    last = None
    for path, r in rows.items():
        if path in ("transformers", "func", "checkpoint", "fp8"):     # paths it does not plan
            continue
        last = psf.plan_memory(config, shape.tokens, cfg=path_config(path, cf),
                               optimizer=_PLANNED[optimizer],
                               offload=optimizer == "adamw-offload")
        measured = r["absolute"] / 2**30 if r else float("nan")
        print(f"{path:<14}{last.peak / 2**30:>10.2f}{measured:>14.2f}"
              f"{last.peak / 2**30 / measured:>15.3f}{last.peak_at:>11}")
    if last is not None:
        print(f"\nplan of the last path, by term:\n{last.table()}", flush=True)


def _table(shape, rows):
    ref = rows.get("transformers")
    print(f"\n{'path':<14}{'ms':>9}{'tokens/s':>11}{'x hf':>7}{'MFU':>7}{'peak MiB':>11}"
          f"{'x hf':>7}{'held MiB':>10}{'reruns':>8}{'loss - hf':>12}")
    for path, r in rows.items():
        if r is None:
            print(f"{path:<14}{'out of memory':>20}")
            continue
        tps = shape.tokens / r["s"]
        mfu = tps * shape.flops_per_token() / PEAK_FLOPS
        speed = f"{ref['s'] / r['s']:.2f}" if ref else "-"
        mem = f"{r['peak'] / ref['peak']:.2f}" if ref else "-"
        dloss = f"{r['loss'] - ref['loss']:+.2e}" if ref else "-"
        print(f"{path:<14}{r['s'] * 1e3:>9.1f}{tps:>11.0f}{speed:>7}{mfu:>7.1%}"
              f"{r['peak'] / 2**20:>11.0f}{mem:>7}{r['held'] / 2**20:>10.0f}"
              f"{str(r['reruns']) + '/' + str(r['steps']):>8}{dloss:>12}")
    for path in ("compiled", "compiled-graphed"):
        if rows.get(path):
            print(f"{path}: its first step, which compiles, took {rows[path]['first_s']:.1f} s")
    print(f"(peak: the most a step adds over what was allocated before the path started, "
          f"gradients and pools included; MFU over {PEAK_FLOPS / 1e12:.0f} TFLOP/s)", flush=True)
    _split_rows(rows)
    _kind_rows(rows)


def _kind_rows(rows) -> None:
    """With ``--profile``: each path's CUDA time by kind of kernel (one profiled step, ms),
    side by side, and their sum."""
    kinds = {p: r["kinds"] for p, r in rows.items() if r and r.get("kinds")}
    if not kinds:
        return
    order = [k for k, _ in KERNEL_KINDS if any(k in v for v in kinds.values())]
    width = max(len(k) for k in order) + 2
    print(f"\n{'CUDA ms by kind of kernel':<{width}}"
          + "".join(f"{p:>{max(10, len(p) + 2)}}" for p in kinds))
    for kind in [*order, "sum"]:
        cells = [v.get(kind, 0.0) if kind != "sum" else sum(v.values())
                 for v in kinds.values()]
        print(f"{kind:<{width}}" + "".join(f"{c * 1e3:>{max(10, len(p) + 2)}.1f}"
                                           for c, p in zip(cells, kinds)))
    print("(one profiled step each, the kernels' own time summed: kernels that ran at once, "
          "as the stash's copies beside the GEMMs on a side stream, count in full, so the sum "
          "is not the GPU's busy time)", flush=True)


def host_rss_peak() -> int:
    """The process's peak resident host memory so far, in bytes (0 where unknown)."""
    try:
        import resource
    except ImportError:          # not on Windows
        return 0
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * (1 if sys.platform == "darwin" else 1024)


def _split_rows(rows) -> None:
    """Where each path's step goes with an optimizer (medians, ms): the gradients, the
    optimizer's step on the device's clock, and offloaded, the host's parts, the copies and
    how much of them ran at once; then the optimizer's memory."""
    split = {p: r for p, r in rows.items() if r and r.get("split")}
    if not split:
        return
    offloaded = any("host_wall" in r["split"] for r in split.values())
    head = f"\n{'where it goes':<14}{'grads ms':>10}{'optimizer ms':>14}"
    if offloaded:
        head += (f"{'host':>8}{'for grads':>11}{'AdamW':>8}{'casts':>8}{'waits':>8}"
                 f"{'to host':>9}{'to GPU':>8}{'overlap':>9}")
    print(head)
    for path, r in split.items():
        t = {k: v * 1e3 for k, v in r["split"].items()}
        line = f"{path:<14}{t['grads']:>10.1f}{t['optimizer']:>14.1f}"
        if "host_wall" in t:
            serial = t["host_optimizer"] + t["host_cast"] + t["host_to_host"] \
                + t["host_to_device"]
            line += (f"{t['host_wall']:>8.1f}{t['host_gradients']:>11.1f}"
                     f"{t['host_optimizer']:>8.1f}{t['host_cast']:>8.1f}{t['host_wait']:>8.1f}"
                     f"{t['host_to_host']:>9.1f}{t['host_to_device']:>8.1f}"
                     f"{serial - t['optimizer']:>9.1f}")
        print(line)
    if offloaded:
        print("(host: the host's whole optimizer step, of it: waiting for the backward's "
              "gradients, AdamW, rounding the masters to bf16, waiting for copies; to host, "
              "to GPU: the side stream's copies, the writes into the weights included; "
              "overlap: AdamW, casts and both copies summed, less the optimizer's span: how "
              "much of them ran at once, a lower bound, since the span also holds making the "
              "gradient pieces and any idle time)")
    for path, r in split.items():
        if "state_bytes" in r:
            where = "in host memory" if r["offloaded"] else "on the GPU"
            pinned = f", {r['pinned_bytes'] / 2**30:.2f} GiB pinned" if r["offloaded"] else ""
            print(f"{path}: optimizer state {r['state_bytes'] / 2**30:.2f} GiB {where}{pinned}")
    rss = host_rss_peak() if any("state_bytes" in r for r in split.values()) else 0
    if rss:
        print(f"the process's peak host memory: {rss / 2**30:.1f} GiB (over every path so far, "
              f"and the host copy of the starting weights where several paths ran)", flush=True)


def _probe(shape, path, cf, optimizer, micro, loss_chunk) -> dict | None:
    """One fresh process: ``micro`` micro-batches on ``path``; its row, or None (no fit)."""
    args = [sys.executable, "-m", "pagedstash_func", "bench", "train", "--model", shape.model,
            "--layers", str(shape.layers), "--seq", str(shape.seq),
            "--tokens", str(micro * shape.seq), "--paths", path, "--capacity-factor", str(cf),
            "--iters", "1", "--warmup", "1", "--probe", "--loss-chunk", str(loss_chunk)]
    if optimizer:
        args += ["--optimizer", optimizer]
    widths = {k: v for k, v in dataclasses.asdict(shape).items()
              if k not in ("model", "layers", "tokens", "seq")
              and v != MODELS[shape.model].get(k, Shape.__dataclass_fields__[k].default)}
    if widths:                 # --shape overrides travel to the probe
        args += ["--shape", ",".join(f"{k}={v}" for k, v in widths.items())]
    run = subprocess.run(args, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    for line in run.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            return row if row.get("ok") else None
    return None


def _max_tokens(shape, paths, cf, optimizer, device, loss_chunk):
    """The most micro-batches of ``shape.seq`` each path fits: doubling, then bisection."""
    print(f"bench train --max-tokens --model {shape.model}: {shape.layers} layers, micro-batches "
          f"of {shape.seq}{', AdamW' if optimizer else ''}; {device_name(device)}", flush=True)
    found = {}
    for path in paths:
        rows = {}

        def fits(micro, path=path, rows=rows):
            rows[micro] = _probe(shape, path, cf, optimizer, micro, loss_chunk)
            print(f"  {path}: {micro} x {shape.seq} {'fits' if rows[micro] else 'does not fit'}",
                  flush=True)
            return rows[micro] is not None
        most = largest_fitting(fits, limit=512)
        found[path] = (most, rows.get(most))
    ref = found.get("transformers", (0, None))
    print(f"\n{'path':<14}{'max tokens':>12}{'x hf':>7}{'tokens/s there':>16}{'x hf':>7}")
    for path, (micro, row) in found.items():
        tokens = micro * shape.seq
        tps = tokens / row["s"] if row else 0.0
        ref_tps = ref[0] * shape.seq / ref[1]["s"] if ref[1] else 0.0
        print(f"{path:<14}{tokens:>12}{tokens / max(1, ref[0] * shape.seq):>7.2f}"
              f"{tps:>16.0f}{tps / ref_tps if ref_tps else 0:>7.2f}", flush=True)
    return found
