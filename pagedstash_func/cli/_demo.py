"""The main job: train a tiny MoE transformer (causal self-attention, MoE feed-forward) on a
character text shipped with the package.

``python -m pagedstash_func demo`` runs it on the CPU; ``--device cuda`` on a GPU. Every step
goes through `run_step`: capacity path first, one flag read, a dropless rerun when needed.
"""

from __future__ import annotations

import importlib.resources
import math
import statistics
import time

import torch
import torch.utils._pytree as pytree

import pagedstash_func as psf


def corpus() -> str:
    return importlib.resources.files("pagedstash_func").joinpath("data/corpus.txt").read_text()


HEADS = 4      # attention heads of the demo's model


def init_model(vocab: int, *, hidden=64, ffn=96, experts=8, layers=2, seq=32, seed=0,
               device="cpu") -> dict:
    """Embedding, position table, ``layers`` transformer blocks (causal self-attention
    ``attn[i]``, MoE feed-forward ``blocks[i]``) and an output head (a dict pytree)."""
    if hidden % HEADS:
        raise ValueError(f"hidden={hidden} must be a multiple of the {HEADS} attention heads")
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(device)

    blocks = [psf.moe_init(experts, hidden, ffn, generator=g, device=device)
              for _ in range(layers)]
    attn = [{"wqkv": normal(hidden, 3 * hidden, std=hidden ** -0.5),
             "wo": normal(hidden, hidden, std=(2 * layers * hidden) ** -0.5)}
            for _ in range(layers)]
    return {"embed": normal(vocab, hidden, std=0.5), "pos": normal(seq, hidden, std=0.1),
            "attn": attn, "blocks": blocks, "head": normal(hidden, vocab, std=hidden ** -0.5)}


def attention(p, x):
    """Causal multi-head self-attention of ``x [B, S, H]`` (scaled dot product)."""
    b, s, h = x.shape
    q, k, v = (x @ p["wqkv"]).view(b, s, 3, HEADS, h // HEADS).permute(2, 0, 3, 1, 4)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, s, h) @ p["wo"]


def rms_norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def forward(params, tokens, padding, top_k=2, group=None, dtype=None):
    """``tokens [B, S]`` -> logits ``[B, S, V]``: pre-norm blocks of causal self-attention and
    an MoE feed-forward.

    Positions where ``padding [B, S]`` is true (a row's tail: causal attention never lets a real
    position see them) are routed to padding id ``-1``: they reach no expert, take no capacity
    and no pages. ``dtype``: compute in it (bf16 for grouped GEMMs on
    a GPU) from fp32 master parameters, cast here; ``group``: experts sharded over it.
    """
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    x = cast(params["embed"][tokens] + params["pos"][: tokens.shape[1]])
    pad = padding.reshape(-1, 1)
    for attn, block in zip(params["attn"], params["blocks"]):
        x = x + attention({k: cast(v) for k, v in attn.items()}, rms_norm(x))
        bias = block.get("router_bias")         # aux-loss-free balancing: chooses only
        block = {k: cast(v) for k, v in block.items() if k != "router_bias"}
        h = rms_norm(x)
        ids, weights = psf.route(block["router"], h.reshape(-1, h.shape[-1]), top_k,
                                 bias=bias)
        ids = torch.where(pad, -1, ids)
        x = x + psf.moe(block, h, top_k=top_k, routing=(ids, weights), group=group)
    return rms_norm(x).to(params["head"].dtype) @ params["head"]


def make_loss_fn(group=None, dtype=None):
    """The demo's loss with its experts over ``group`` and computed in ``dtype``."""
    def loss_fn(params, batch):
        """Next-character cross-entropy over real positions; aux is the accuracy."""
        tokens, padding = batch["tokens"], batch["padding"]
        logits = forward(params, tokens[:, :-1], padding[:, :-1], group=group, dtype=dtype)
        targets = torch.where(padding[:, 1:], -100, tokens[:, 1:])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1), ignore_index=-100)
        real = targets != -100
        accuracy = ((logits.argmax(-1) == targets) & real).sum() / real.sum()
        return loss, {"accuracy": accuracy}
    return loss_fn


loss_fn = make_loss_fn()


def make_batch(data: torch.Tensor, step: int, *, batch_size: int, seq: int, seed: int,
               rank: int = 0, ranks: int = 1):
    """Windows of ``seq + 1`` characters, each cut to a random length in ``[seq/2, seq+1]``
    and padded, drawn with a generator seeded by (seed, step): a packed batch in miniature.
    With ``ranks > 1``, the global batch has ``ranks * batch_size`` rows and this is rank
    ``rank``'s slice of it."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    rows = batch_size * ranks
    starts = torch.randint(0, len(data) - seq - 1, (rows,), generator=g)
    lengths = torch.randint(seq // 2, seq + 2, (rows,), generator=g)
    padding = torch.arange(seq + 1)[None, :] >= lengths[:, None]
    tokens = torch.stack([data[s: s + seq + 1] for s in starts.tolist()])
    mine = slice(rank * batch_size, (rank + 1) * batch_size)
    return {"tokens": torch.where(padding, 0, tokens)[mine], "padding": padding[mine]}


HF_MODELS = ("qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "deepseek_v3")


def hf_model(name: str, vocab: int, *, seq=32, seed=0, device="cpu", dtype=None, hidden=64,
             ffn=96):
    """A tiny random-init transformers causal LM of family ``name`` (interop extra), its
    width ``hidden`` and its experts' ``ffn``."""
    if name not in HF_MODELS:
        raise ValueError(f"--model {name!r}: choose one of {', '.join(HF_MODELS)}")
    if name == "deepseek_v3" and hidden % 16:
        raise ValueError(f"deepseek_v3 splits its heads' width into rotary and plain halves "
                         f"of hidden / 8 each, which must be even: pass a hidden size that is "
                         f"a multiple of 16, got {hidden}")
    try:
        import transformers
    except ImportError:
        raise ValueError("--model needs transformers: pip install -e '.[interop]'") from None
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=seq + 1,
                  attn_implementation="sdpa", pad_token_id=0, bos_token_id=None,
                  eos_token_id=None, tie_word_embeddings=False)
    if name == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=ffn, num_experts=8,
                                          head_dim=hidden // 4, **common)
    elif name == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=ffn, num_experts=8, **common)
    elif name == "qwen2_moe":               # a gated shared expert beside the routed ones
        cfg = transformers.Qwen2MoeConfig(moe_intermediate_size=ffn, num_experts=8,
                                          shared_expert_intermediate_size=ffn, **common)
    elif name == "deepseek_v3":             # sigmoid routing in groups, a shared expert, MLA
        cfg = transformers.DeepseekV3Config(
            moe_intermediate_size=ffn, intermediate_size=2 * ffn, n_routed_experts=8,
            n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            first_k_dense_replace=0, q_lora_rank=hidden // 2, kv_lora_rank=hidden // 2,
            qk_rope_head_dim=hidden // 8, qk_nope_head_dim=hidden // 8, v_head_dim=hidden // 4,
            **{**common, "num_key_value_heads": 4})
    else:
        cfg = transformers.MixtralConfig(intermediate_size=ffn, num_local_experts=8, **common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.to(device=device, dtype=dtype or torch.float32).train()


def hf_batch(batch: dict) -> dict:
    """The demo's ``tokens``/``padding`` batch as transformers' ``input_ids``, ``labels``
    (-100 on padding) and ``attention_mask``."""
    tokens, padding = batch["tokens"], batch["padding"]
    return {"input_ids": tokens, "labels": tokens.masked_fill(padding, -100),
            "attention_mask": (~padding).long()}


def adam(params, grads, moments, step, lr=3e-3, betas=(0.9, 0.99), eps=1e-8):
    """One Adam update as a pure function of pytrees: ``(params, moments)`` out."""
    m, v = moments
    m = pytree.tree_map(lambda m_, g: betas[0] * m_ + (1 - betas[0]) * g, m, grads)
    v = pytree.tree_map(lambda v_, g: betas[1] * v_ + (1 - betas[1]) * g * g, v, grads)
    c1, c2 = 1 - betas[0] ** step, 1 - betas[1] ** step
    params = pytree.tree_map(lambda p, m_, v_: p - lr * (m_ / c1) / ((v_ / c2).sqrt() + eps),
                             params, m, v)
    return params, (m, v)


class Tally:
    """What the steps of a run did: reruns and why, pages needed against the pools."""

    def __init__(self):
        self.losses, self.reasons, self.reruns, self.overflows = [], {}, 0, 0
        self.pages_peak, self.pages_available, self.stash_bytes, self.padded_bytes = \
            {}, {}, 0, 0
        self.pool_contents = {}
        self.step_seconds, self.reran = [], []
        self.imbalance = []          # per step: the busiest expert over the mean, worst layer

    def add(self, res, seconds: float) -> None:
        report = res.report
        self.losses.append(float(res.loss))
        self.step_seconds.append(seconds)
        self.reran.append(bool(report.reran))
        self.imbalance.append(max((layer.expert_imbalance for layer in report.layers),
                                  default=0.0))
        self.reruns += report.reran
        self.overflows += report.overflow
        for r in report.reasons:
            self.reasons[r] = self.reasons.get(r, 0) + 1
        for pool, need in report.pages_needed.items():
            self.pages_peak[pool] = max(self.pages_peak.get(pool, 0), need)
        self.pages_available.update(report.pages_available)
        self.pool_contents.update(report.pool_contents)
        self.stash_bytes = max(self.stash_bytes, report.stash_bytes)
        self.padded_bytes = max(self.padded_bytes, report.padded_bytes)

    def show(self, bar, i: int, steps: int, print_fn=None) -> None:
        """The progress bar's figures; with ``print_fn``, a log line every tenth of the run."""
        bar.set_postfix(loss=f"{self.losses[-1]:.3f}", reruns=self.reruns)
        if print_fn is not None and (i % max(1, steps // 10) == 0 or i == steps - 1):
            print_fn(f"step {i:>4}  loss {self.losses[-1]:.3f}  reruns so far {self.reruns}")

    def summary(self, steps: int, seconds: float, cfg, device) -> dict:
        """What `train` returns."""
        return {"losses": self.losses, "reruns": self.reruns, "reasons": self.reasons,
                "overflows": self.overflows, "steps": steps, "pages_peak": self.pages_peak,
                "pages_available": self.pages_available, "stash_bytes": self.stash_bytes,
                "padded_bytes": self.padded_bytes, "pool_contents": self.pool_contents,
                "seconds": seconds, "step_seconds": self.step_seconds, "reran": self.reran,
                "imbalance": self.imbalance,
                "config": cfg,
                "peak_bytes": torch.cuda.max_memory_allocated() if device != "cpu" else 0}


def train(steps=60, *, device="cpu", capacity_factor=1.1, expert_ranks=2, paged_stash=True,
          cuda_factor=0.9, host_factor=0.0, batch_size=16, seq=32, seed=0, progress=True,
          print_fn=print, group=None, dtype=None, graph=False, model=None,
          bias_rate=0.0) -> dict:
    """Train and return a summary (losses, reruns and reasons, pages, stash bytes, time).

    ``group``: spread the experts over its ranks, or over the ``ep`` dim of a ``("dp", "ep")``
    mesh (each rank trains on its slice of the batch; gradients are summed with
    `psf.reduce_gradients`). ``graph``: run each
    step's attempt from a captured CUDA graph (`psf.graphed`; needs CUDA and bf16).
    ``model``: train a tiny transformers model of that family (`HF_MODELS`) through
    `psf.from_hf_model` instead, with ``torch.optim.AdamW`` (its weights in ``dtype``).
    ``bias_rate``: aux-loss-free balancing, each layer routing with a ``router_bias`` moved
    by `psf.update_expert_bias` after every step (not trained: its gradient is zero).
    """
    from tqdm.auto import tqdm
    text = corpus()
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text])
    if model is not None:
        if group is not None:
            raise ValueError("--model trains on one process: run it without torchrun")
        return _train_hf(model, steps, data, len(vocab), device=device, dtype=dtype,
                         capacity_factor=capacity_factor, expert_ranks=expert_ranks,
                         paged_stash=paged_stash, cuda_factor=cuda_factor,
                         host_factor=host_factor, batch_size=batch_size, seq=seq, seed=seed,
                         progress=progress, print_fn=print_fn, graph=graph)
    params = init_model(len(vocab), seq=seq, seed=seed, device=device)
    if group is None:
        rank, ranks = 0, 1
    else:                      # every rank its slice of the global batch (dp and ep alike)
        import torch.distributed as dist
        rank, ranks = dist.get_rank(), dist.get_world_size()
    if group is not None:
        params["blocks"] = [psf.shard_experts(b, group) for b in params["blocks"]]
    if bias_rate:
        for block in params["blocks"]:
            block["router_bias"] = torch.zeros(block["router"].shape[0], device=device)
    cfg = psf.StashConfig(capacity_factor=capacity_factor, paged_stash=paged_stash,
                          expert_ranks=1 if group is not None else expert_ranks,
                          cuda_factor=cuda_factor, host_factor=host_factor)
    step = psf.stash_aware(make_loss_fn(group, dtype), cfg)
    run = psf.graphed(step) if graph else (lambda *a: psf.run_step(step, *a))

    def batch_at(i):
        return {k: v.to(device) for k, v in make_batch(
            data, i, batch_size=batch_size, seq=seq, seed=seed, rank=rank, ranks=ranks).items()}

    state = step.init(params, batch_at(0))
    moments = (pytree.tree_map(torch.zeros_like, params),) * 2   # adam never writes in place
    tally = Tally()
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="train", disable=not progress or rank > 0, leave=False)
    for i in bar:
        began = time.perf_counter()
        res = run(params, batch_at(i), state)
        state, grads = res.state, res.grads
        if group is not None:
            grads = psf.reduce_gradients(grads, group)
        params, moments = adam(params, grads, moments, i + 1)
        if bias_rate:                  # between steps; each layer's loads from the report
            for block, layer in zip(params["blocks"], res.report.layers):
                block["router_bias"] = psf.update_expert_bias(   # a mesh: also over dp
                    block["router_bias"], layer.expert_load, rate=bias_rate,
                    group=group if group is not None and not isinstance(
                        group, torch.distributed.ProcessGroup) else None)
        tally.add(res, time.perf_counter() - began)
        tally.show(bar, i, steps, print_fn if not progress and rank == 0 else None)
    return tally.summary(steps, time.perf_counter() - start, cfg, device)


def _train_hf(name, steps, data, vocab, *, device, dtype, capacity_factor, expert_ranks,
              paged_stash, cuda_factor, host_factor, batch_size, seq, seed, progress, print_fn,
              graph) -> dict:
    """`train` of a tiny transformers model through `psf.from_hf_model`."""
    from tqdm.auto import tqdm
    model = hf_model(name, vocab, seq=seq, seed=seed, device=device, dtype=dtype)
    params, loss_fn = psf.from_hf_model(model)
    opt = torch.optim.AdamW(psf.trainable(params), lr=3e-3)
    cfg = psf.StashConfig(capacity_factor=capacity_factor, paged_stash=paged_stash,
                          expert_ranks=expert_ranks, cuda_factor=cuda_factor,
                          host_factor=host_factor)
    step = psf.stash_aware(loss_fn, cfg)
    run = psf.graphed(step, donate=True, copy_grads=False) if graph \
        else (lambda *a: psf.run_step(step, *a))

    def batch_at(i):
        return {k: v.to(device) for k, v in hf_batch(make_batch(
            data, i, batch_size=batch_size, seq=seq, seed=seed)).items()}

    state = step.init(params, batch_at(0))
    tally = Tally()
    start = time.perf_counter()
    bar = tqdm(range(steps), desc=f"train {name}", disable=not progress, leave=False)
    for i in bar:
        began = time.perf_counter()
        res = run(params, batch_at(i), state)
        state = res.state
        psf.set_grads(params, res.grads)
        opt.step()                 # in place: params alias the model, which trains too
        tally.add(res, time.perf_counter() - began)
        tally.show(bar, i, steps, None if progress else print_fn)
    return {**tally.summary(steps, time.perf_counter() - start, cfg, device), "model": model}


def dist_rank(group) -> int:
    """This process's rank in the world (a mesh spans the world too)."""
    import torch.distributed as dist
    return dist.get_rank()


def dist_size(group) -> int:
    """The ranks the experts are spread over: the group's, or a mesh's ``ep`` dim."""
    import torch.distributed as dist
    if hasattr(group, "get_group"):           # a ("dp", "ep") DeviceMesh
        group = group.get_group("ep")
    return dist.get_world_size(group)


_KINDS = {"fc1_in": "fc1 input rows", "act_in": "activation input rows (gate | up)"}


def run_demo(steps=60, device=None, capacity_factor=1.1, expert_ranks=2, paged_stash=True,
             cuda_factor=0.9, host_factor=0.0, seed=0, progress=True, dtype=None,
             graph=False, model=None, bias_rate=0.0, ep=None) -> dict:
    """`train`, then print what happened. Under ``torchrun`` (``WORLD_SIZE > 1``) the experts
    are spread over the ranks (gloo on the CPU, NCCL with ``device="cuda"``), or with ``ep``
    below the world size over ``ep`` of them inside ``WORLD_SIZE / ep`` data-parallel
    replicas (a ``("dp", "ep")`` mesh); rank 0 prints one summary with every rank's
    figures."""
    device = device or "cpu"
    group = _start_distributed(device, ep)
    rank = 0 if group is None else dist_rank(group)
    if group is None:
        where = device
    else:
        import torch.distributed as dist
        world = dist.get_world_size()
        where = f"{world} ranks ({device}, experts spread over {dist_size(group)} of them" + \
            (f", {world // dist_size(group)} data-parallel replicas)" if
             dist_size(group) < world else ")")
    asked = expert_ranks
    expert_ranks = expert_ranks if group is None else dist_size(group)   # real ranks now
    if rank == 0 and asked != expert_ranks:
        print(f"note: under torchrun the experts are spread over the {expert_ranks} real ranks, "
              f"so --expert-ranks {asked} is not used", flush=True)
    if rank == 0:
        what = f"transformers {model} model" if model else "MoE transformer"
        print(f"training a tiny {what} on characters for {steps} steps on {where} "
              f"(capacity_factor={capacity_factor}, expert_ranks={expert_ranks}, "
              f"paged_stash={paged_stash}, cuda_factor={cuda_factor}, host_factor="
              f"{host_factor}, dtype={dtype or 'float32'}, graph={graph})", flush=True)
    try:
        out = train(steps, device=device, capacity_factor=capacity_factor,
                    expert_ranks=expert_ranks, paged_stash=paged_stash, cuda_factor=cuda_factor,
                    host_factor=host_factor, seed=seed, progress=progress, group=group,
                    dtype=dtype, graph=graph, model=model, bias_rate=bias_rate)
        every = _gather(out, group)
        if rank == 0:
            _print_summary(every, steps)
    finally:
        if group is not None:
            import torch.distributed as dist
            dist.destroy_process_group()
    if not math.isfinite(out["losses"][-1]):
        raise RuntimeError("training diverged")
    return out


def _start_distributed(device, ep=None):
    import os
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    import torch.distributed as dist
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if ep is None or ep == world:
        return dist.group.WORLD
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device, (world // ep, ep), mesh_dim_names=("dp", "ep"))


def _gather(out, group) -> list[dict]:
    summary = {k: v for k, v in out.items() if k not in ("config", "model")}
    if group is None:
        return [summary]
    import torch.distributed as dist
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, summary)
    return every


def _print_summary(every, steps) -> None:
    out = every[0]
    losses = out["losses"]
    marks = sorted({0, len(losses) // 4, len(losses) // 2, 3 * len(losses) // 4,
                    len(losses) - 1})
    print("loss:  " + "  ".join(f"step {i}: {losses[i]:.3f}" for i in marks))
    why = ", ".join(f"{k} x{v}" for k, v in out["reasons"].items()) or "none"
    print(f"reruns: {out['reruns']} of {steps} steps ({out['reruns'] / steps:.0%}); "
          f"reasons: {why}")
    tenth = max(1, len(out["imbalance"]) // 10)
    print(f"expert load, busiest over mean (worst layer): first {tenth} steps "
          f"{statistics.mean(out['imbalance'][:tenth]):.2f}, last {tenth} steps "
          f"{statistics.mean(out['imbalance'][-tenth:]):.2f}")
    for rank, r in enumerate(every):
        prefix = f"rank {rank}: " if len(every) > 1 else ""
        for line in _pages_lines(r, steps):
            print(prefix + line)
        if r["peak_bytes"]:
            print(f"{prefix}peak device memory {r['peak_bytes'] / 2**20:.0f} MiB")
    print(f"wall time {out['seconds']:.1f} s ({out['seconds'] / steps * 1e3:.0f} ms/step)")
    plain = [t for t, r in zip(out["step_seconds"][1:], out["reran"][1:]) if not r]
    rerun = [t for t, r in zip(out["step_seconds"][1:], out["reran"][1:]) if r]
    print("median ms/step after the first: " + ", ".join(
        f"{statistics.median(ts) * 1e3:.1f} on {len(ts)} {what if len(ts) > 1 else one}"
        for ts, what, one in ((plain, "steps that did not rerun", "step that did not rerun"),
                              (rerun, "steps that reran", "step that reran")) if ts))


def _pages_lines(out, steps) -> list[str]:
    """Pages each pool's stashes needed at peak against what the pool has, and what that
    meant: read with the rerun line (an overflow reruns the step on the exact path)."""
    if not out["pages_peak"]:
        return []
    lines = ["pages at peak (most a step's stashes needed, per pool):"]
    for pool, need in out["pages_peak"].items():
        device_pages, host_pages = out["pages_available"][pool]
        what = ", ".join(_KINDS.get(k, k) for k in out["pool_contents"].get(pool, ()))
        fits = need <= device_pages + host_pages
        verdict = ("fits in the device pool" if need <= device_pages else
                   "spills to the host pool" if fits else
                   "more than the pools hold: those steps overflowed and reran exactly")
        lines.append(f"  {pool}{f' ({what})' if what else ''}: {need} needed; pool has "
                     f"{device_pages} device + {host_pages} host pages; {verdict}")
    if out["overflows"] and any(need > sum(out["pages_available"][pool])
                                for pool, need in out["pages_peak"].items()):
        lines.append(f"  {out['overflows']} of {steps} steps overflowed: raise --cuda-factor "
                     f"(or add --host-factor) to keep their stash")
    saved = 1 - out["stash_bytes"] / out["padded_bytes"] if out["padded_bytes"] else 0
    lines.append(f"stash at peak {out['stash_bytes'] / 2**10:.0f} KiB of pages against "
                 f"{out['padded_bytes'] / 2**10:.0f} KiB of capacity-padded buffers "
                 f"({saved:.0%} less), on steps whose stash fit")
    return lines
