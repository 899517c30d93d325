"""`plan_memory`: every rank's memory for a training step of a transformers MoE model, before
launch, from the tree the step would train and the sizes the step would allocate.

The held terms are counted, not estimated: the parameter tree is `from_hf_model`'s, built on
the meta device (nothing allocated), with each rank's experts cut as `from_hf_config` cuts
them; optimizer pieces are `sharded_optimizer`'s (``ceil(n / S)`` elements a parameter over
the ``S`` ranks that replicate it); pools are `pool_layouts` of `moe_stash_specs`, capacity
buffers `capacity_rows`. What autograd keeps per layer is written out tensor by tensor below
(`_saved_per_layer`), as the step's functions save it; the peak is the largest of the moments
a step passes through (`_moments`), each the sum of what is alive then.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

__all__ = ["MemoryPlan", "plan_memory"]

FAMILIES = ("qwen3_moe", "olmoe", "mixtral")
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What one rank holds for a training step, in bytes (every rank of a mesh alike: each
    holds the same share of experts).

    Attributes:
        ranks: ``{"dp": ..., "ep": ...}``, the mesh the plan is for.
        tokens: tokens a step routes on each rank.
        weights: the parameters this rank holds (its experts, every replicated tensor).
        gradients: their gradients (`run_step`'s ``res.grads``: the parameters' dtype).
        master: fp32 master weights on the device (0 without an optimizer or offloaded).
        optimizer_state: the optimizer's moments on the device (0 likewise).
        activations: ``{"attention", "routing", "experts", "mlp", "stash_pools",
            "lm_loss"}``, what the step keeps for backward at the end of its forward (``mlp``:
            dense layers' MLPs).
        workspace: the largest transient on top of what is held at the peak's moment.
        peak: the predicted most allocated at once over forward, backward and the
            optimizer's step (weights and states included).
        peak_at: the moment of the peak (``"forward"``, ``"loss"``, ``"backward"``,
            ``"optimizer"``).
        at_peak: what is alive at that moment, by term (`terms`): at the backward only the
            head's and the top layer's gradients, at the optimizer every gradient and no
            activation.
        host: host bytes of an offloaded optimizer (masters and moments).
        pinned_host: pinned host bytes (the offloaded optimizer's copy slots).
        by_moment: every moment's terms, as `at_peak` gives the peak's: ``{moment: {term:
            bytes}}`` (``"workspace"`` at ``"optimizer"``: the gradient pieces the step holds
            at once, and the rows the widest is reduced from).
    """

    ranks: dict
    tokens: int
    weights: int
    gradients: int
    master: int
    optimizer_state: int
    activations: dict
    workspace: int
    peak: int
    peak_at: str
    at_peak: dict = dataclasses.field(default_factory=dict)
    host: int = 0
    pinned_host: int = 0
    by_moment: dict = dataclasses.field(default_factory=dict)

    def terms(self) -> dict:
        """What is alive at the peak's moment, by term (activations by kind), largest
        first; they sum to ``peak``."""
        return dict(sorted(self.at_peak.items(), key=lambda kv: -kv[1]))

    def check(self, device_bytes: int) -> None:
        """`ValueError` naming what overflows if the peak exceeds ``device_bytes``.

        Args:
            device_bytes: the device's memory (``torch.cuda.mem_get_info()[1]``).

        Raises:
            ValueError: the peak exceeds it; the message names the largest terms and what
                would shrink each.
        """
        if isinstance(device_bytes, bool) or not isinstance(device_bytes, int) \
                or device_bytes < 1:
            raise ValueError(f"device_bytes must be a positive number of bytes (e.g. "
                             f"torch.cuda.mem_get_info()[1]), got {device_bytes!r}")
        if self.peak <= device_bytes:
            return
        alone = self.ranks == {"dp": 1, "ep": 1}
        state = ("offload=True keeps it on the host; optimizer='adamw8bit' halves it"
                 if alone and not self.host else "more ranks share it (a larger dp x ep), "
                 "or optimizer='adamw8bit'")
        fewer = "fewer tokens a step"
        fix = {"optimizer_state": state, "master": state,
               "weights": "more ep ranks split the experts (ZeRO-1 leaves the replicated "
                          "weights whole on every rank)",
               "gradients": "more ep ranks split the experts' gradients",
               "activations.stash_pools": "a smaller cuda_factor",
               "activations.experts": "paged_stash=True keeps only the valid rows",
               "activations.attention": fewer, "activations.lm_loss": fewer,
               "activations.routing": fewer, "activations.mlp": fewer,
               "workspace": fewer if self.peak_at != "optimizer" else (
                   "the optimizer's fp32 gradient pieces: " + (
                       "a bucket at a time already" if alone
                       else "a bucket at a time without max_norm; more ranks share them"))}
        top = list(self.terms().items())[:3]
        named = "; ".join(f"{k} {v / GiB:.2f} GiB ({fix[k]})" for k, v in top)
        raise ValueError(f"the plan's peak, {self.peak / GiB:.2f} GiB at the {self.peak_at}, "
                         f"exceeds the device's {device_bytes / GiB:.2f} GiB by "
                         f"{(self.peak - device_bytes) / GiB:.2f} GiB; the largest terms: "
                         f"{named}")

    def table(self) -> str:
        """The plan as a printable table (GiB): what is alive at the peak, then what the
        step keeps at the end of its forward, by kind."""
        rows = [f"{'alive at the peak':<28}{'GiB':>9}"]
        rows += [f"{k:<28}{v / GiB:>9.3f}" for k, v in self.terms().items()]
        rows.append(f"{'peak (' + self.peak_at + ')':<28}{self.peak / GiB:>9.3f}")
        rows.append(f"{'kept for backward':<28}")
        rows += [f"{'  ' + k:<28}{v / GiB:>9.3f}" for k, v in self.activations.items()]
        if self.host:
            rows.append(f"{'host (offloaded state)':<28}{self.host / GiB:>9.3f}")
        if self.pinned_host:
            rows.append(f"{'pinned host':<28}{self.pinned_host / GiB:>9.3f}")
        return "\n".join(rows)


def _mesh_sizes(mesh) -> tuple[int, int]:
    """``(dp, ep)`` of a ``("dp", "ep")`` mesh, a process group (ep alone), ``None``, or a
    ``{"dp": n, "ep": m}`` dict of sizes (to plan for ranks not started)."""
    from ..parallel._mesh import check_mesh, ep_size, is_mesh
    if mesh is None:
        return 1, 1
    if isinstance(mesh, dict):
        if set(mesh) - {"dp", "ep"} or not all(isinstance(v, int) and not isinstance(v, bool)
                                                and v >= 1 for v in mesh.values()):
            raise ValueError(f"mesh as sizes is {{'dp': n, 'ep': m}} with positive integers, "
                             f"got {mesh!r}")
        return mesh.get("dp", 1), mesh.get("ep", 1)
    if is_mesh(mesh):
        check_mesh(mesh)
        return mesh["dp"].size(), mesh["ep"].size()
    if not isinstance(mesh, getattr(torch.distributed, "ProcessGroup", ())):
        raise ValueError(f"mesh must be a ('dp', 'ep') DeviceMesh, a process group, "
                         f"{{'dp': n, 'ep': m}} or None, got {mesh!r}")
    return 1, ep_size(mesh)


def _config_of(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"plan_memory plans {', '.join(FAMILIES)} models; got "
                         f"{type(model_or_config).__name__} ({family!r})")
    return config, family


def _tree(config, ep: int, dtype):
    """The parameter tree one rank of ``ep`` trains (meta tensors), its experts cut."""
    import transformers

    from ..parallel._mesh import check_experts_split
    from ..parallel._placement import ExpertShard
    from ._models import from_hf_model
    config = copy.deepcopy(config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    params, _ = from_hf_model(model)

    def cut(node):
        if isinstance(node, dict):
            node = {k: cut(v) for k, v in node.items()}
            if "router" in node and "w_gate_up" in node and ep > 1:   # as from_hf_config
                experts = node["w_gate_up"].shape[0]
                check_experts_split(experts, ep)
                node = ExpertShard(node)
                for name in ExpertShard.SHARDED:
                    node[name] = node[name][:experts // ep]
        return node
    return cut(params), model


def _optimizer_bytes(placed, dp: int, ep: int, offload: bool, optimizer: str):
    """``(master bytes, state bytes, widest piece, widest reduced rows, bytes of the pieces
    ranks reduce, widest piece no rank shares)`` (elements for the pieces and rows: a rank's
    piece of a bucket, and the ``[ranks, piece]`` rows it is reduced from) of
    ``sharded_optimizer``'s buckets, `grouped_buckets` of them, each ``pieces_of`` its
    parameters (masters fp32, fp64 for fp64 parameters). AdamW's moments are two tensors like
    the master; torchao's 8-bit ones a byte an element, an fp32 scale a block and a
    256-entry map, where the bucket is at least 4096 elements (else fp32, as torchao keeps
    them)."""
    from ..parallel._placement import EXPERTS
    from ..parallel._zero import grouped_buckets, pieces_of
    block = 256 if optimizer == "adamw8bit" else 1
    masters = state = widest = rows = shared = alone = 0
    for where, chunk in grouped_buckets(placed):
        if offload or (dp, ep) == (1, 1):
            ranks = 1
        else:
            ranks = dp if where == EXPERTS else dp * ep
        _, width = pieces_of([t.numel() for _, t in chunk], ranks, block)
        size = 8 if chunk[0][1].dtype == torch.float64 else 4
        masters += width * size
        if ranks > 1:
            shared += width * size
        else:
            alone = max(alone, width)
        widest, rows = max(widest, width), max(rows, ranks * width)
        if block > 1 and width >= 4096:
            state += 2 * (width + 4 * (width // block) + 4 * 256)
        else:
            state += 2 * width * size
    return masters, state, widest, rows, shared, alone


def _widths(config) -> dict:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    ffn = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    dense_ffn = getattr(config, "intermediate_size", None) or ffn
    renorm = config.model_type == "mixtral" or bool(getattr(config, "norm_topk_prob", False))
    return dict(H=config.hidden_size, heads=heads, head_dim=head_dim, q=heads * head_dim,
                kv=kv_heads * head_dim, kv_heads=kv_heads, E=experts, F=ffn,
                dense_ffn=dense_ffn, k=config.num_experts_per_tok, renorm=renorm,
                V=config.vocab_size, L=config.num_hidden_layers)


def _saved_per_layer(w: dict, family: str, T: int, b: int, rows: int, stashed: bool) -> dict:
    """Bytes one decoder layer keeps for backward, by kind.

    attention: the input norm's input and output ``[T, H]``; the q, k projections before
    their norms (Qwen3-MoE, OLMoE); q and k after rotary and v (sdpa's inputs); sdpa's
    output (o_proj's input); fp32 norms' rstd and sdpa's logsumexp. routing: the MoE
    norm's input and output ``[T, H]``, its rstd, the router's fp32 softmax ``[T, E]``, the
    top-k ids and mask, the kept weights and their sum where they are renormalised, psf's
    dispatch ids and weights. experts: the capacity buffers'
    ``[rows, H]`` fc1 input and ``[rows, 2F]`` activation input (none with the stash: those
    rows are in the pools, `stash_pools`).
    """
    H, q, kv, heads = w["H"], w["q"], w["kv"], w["heads"]
    normed_qk = family in ("qwen3_moe", "olmoe")
    qk_rstd = {"qwen3_moe": heads + w["kv_heads"], "olmoe": 2}.get(family, 0)
    attention = b * T * (2 * H + (3 if normed_qk else 2) * q + (3 if normed_qk else 2) * kv) \
        + 4 * T * (1 + qk_rstd + heads)
    pairs = T * w["k"]
    routing = b * T * 2 * H + 4 * T + 4 * T * w["E"] + 8 * pairs + pairs + 36 * pairs
    if w["renorm"]:            # the kept weights over their sum: both saved, fp32
        routing += 4 * pairs + 4 * T
    experts = 0 if stashed else b * rows * (H + 2 * w["F"])
    return {"attention": attention, "routing": routing, "experts": experts}


def _pools(w: dict, T: int, dtype, cfg, group_size: int, names) -> tuple[int, int]:
    """``(device bytes, pinned host bytes)`` of the stash pools of the MoE layers ``names``,
    as `pool_layouts` sizes them: one pool a layer (``pool_scope="layer"``), or one for
    every layer, held in the state (``"state"``)."""
    from ..stash._pools import moe_stash_specs, pool_layouts
    fake = {"w_gate_up": torch.empty(w["E"], w["H"], 2 * w["F"], dtype=dtype, device="meta")}
    per_layer = [moe_stash_specs(name, fake, tokens=T, top_k=w["k"], cfg=cfg, dtype=dtype,
                                 group_size=group_size)
                 for name in names if cfg.paged_stash and cfg.factor_for(name) is not None]
    groups = per_layer if cfg.pool_scope == "layer" else [sum(per_layer, [])]
    layouts = [lay for specs in groups if specs for lay in pool_layouts(specs, cfg)]
    return (sum(lay.cuda_pages * lay.page_bytes for lay in layouts),
            sum(lay.host_pages * lay.page_bytes for lay in layouts))


def plan_memory(model_or_config, tokens: int, *, mesh=None, optimizer: str | None = "adamw",
                offload: bool = False, max_norm=None, cfg=None, dtype=None) -> MemoryPlan:
    """Every rank's memory for one training step, predicted before launch.

    Args:
        model_or_config: a transformers model or config of a family in `FAMILIES`
            (Qwen3-MoE, OLMoE, Mixtral); nothing is allocated (the tree is built on the meta
            device).
        tokens: tokens a step routes on each rank (batch x sequence).
        mesh: a ``("dp", "ep")`` mesh, a process group (ep alone), ``{"dp": n, "ep": m}``
            (ranks not started yet), or ``None`` (one process).
        optimizer: ``"adamw"`` (`sharded_optimizer` with ``torch.optim.AdamW``: fp32
            masters and two moments, sharded over the ranks that replicate each parameter),
            ``"adamw8bit"`` (the same with torchao's ``AdamW8bit``: 8-bit moments) or
            ``None`` (no optimizer step).
        offload: the optimizer's state in host memory (`sharded_optimizer`'s
            ``offload=True``; one process).
        max_norm: the optimizer's clipping norm (``None``: no clipping). A step goes a
            bucket at a time; clipped over several ranks, it holds besides the fp32 pieces
            that ranks reduce together, from the norm's pass to their step (the norm needs
            them all before the first update; a bucket no rank shares is made again).
        cfg: the step's `StashConfig` (default capacity 1.25, paged stash, pool per layer).
        dtype: the parameters' dtype (default: a model's own; bf16 for a config).

    Returns:
        A `MemoryPlan`; ``plan.check(device_bytes)`` raises what overflows.

    Raises:
        ValueError: an unsupported family or attention, ``tokens`` not a positive integer,
            an unknown optimizer, ``offload`` with a mesh, experts that do not split over
            ``ep``, a bad mesh, config or dtype.

    Example::

        plan = psf.plan_memory(config, 16384, offload=True)
        print(plan.table())
        plan.check(torch.cuda.mem_get_info()[1])
    """
    from ..parallel._offload import SLOTS
    from ..parallel._placement import placements
    config, family, dtype, cfg = _checked(model_or_config, tokens, mesh, optimizer, offload,
                                          cfg, dtype)
    dp, ep = _mesh_sizes(mesh)
    tree, model = _tree(config, ep, dtype)
    placed = placements(tree, ep)
    weights = sum(t.nbytes for _, t, _ in placed)
    masters, moments_all, widest, rows_widest, shared, alone = _optimizer_bytes(
        placed, dp, ep, offload, optimizer) if optimizer else (0,) * 6
    w, b = _widths(config), dtype.itemsize
    sparse = _sparse_count(model)
    activations, rows = _activations(w, family, tokens, dtype, cfg, ep, sparse)
    pools, host_pools = _pools(w, tokens, dtype, cfg, ep, [f"moe{i}" for i in range(sparse[0])])
    activations["stash_pools"] = pools
    state = {"master": 0 if offload else masters,
             "optimizer_state": 0 if offload else moments_all}
    master_size = 8 if dtype == torch.float64 else 4
    # a bucket at a time: its piece and the rows it is reduced from; clipped, the pieces that
    # ranks reduce held from the norm's pass to their step, the others made one at a time
    held_pieces = widest * master_size if max_norm is None else shared + alone * master_size
    optimizer_ws = 0 if not optimizer else held_pieces + rows_widest * (master_size + b)
    moments = _moments(w, tokens, b, rows, weights, state, activations, optimizer_ws,
                       held_pools=cfg.pool_scope == "state")
    peak_at = max(moments, key=lambda k: sum(moments[k].values()))
    at_peak = moments[peak_at]
    return MemoryPlan(ranks={"dp": dp, "ep": ep}, tokens=tokens, weights=weights,
                      gradients=weights, master=state["master"],
                      optimizer_state=state["optimizer_state"], activations=activations,
                      workspace=at_peak["workspace"], peak=sum(at_peak.values()),
                      peak_at=peak_at, at_peak=dict(at_peak),
                      host=masters + moments_all if offload else 0,
                      pinned_host=host_pools + (SLOTS * widest * (master_size + b)
                                                if offload else 0),
                      by_moment={k: dict(v) for k, v in moments.items()})


ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


def _checked(model_or_config, tokens, mesh, optimizer, offload, cfg, dtype):
    """``(config, family, dtype, cfg)`` once `plan_memory`'s arguments are checked: the
    dtype a model's parameters have unless one is given (else bf16), the default config."""
    from ..core._config import StashConfig
    config, family = _config_of(model_or_config)
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if attention not in ATTENTION:
        raise ValueError(f"plan_memory counts what {', '.join(ATTENTION)} attention keeps "
                         f"(a row's output and log-sum-exp); {attention!r} attention keeps "
                         f"each sequence's [S, S] scores, which it does not plan: build the "
                         f"model with attn_implementation='sdpa'")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive integer (per rank), got {tokens!r}")
    if optimizer not in (None, "adamw", "adamw8bit"):
        raise ValueError(f"optimizer must be 'adamw', 'adamw8bit' or None, got {optimizer!r}")
    if offload and optimizer != "adamw":
        raise ValueError("offload steps torch.optim.AdamW on the host: pass "
                         "optimizer='adamw' with offload=True")
    if offload and mesh is not None:
        raise ValueError("offload plans one process's whole state on its host: pass mesh=None "
                         "(a mesh shards the state instead)")
    if cfg is None:
        cfg = StashConfig(capacity_factor=1.25, paged_stash=True, pool_scope="layer")
    elif not isinstance(cfg, StashConfig):
        raise ValueError(f"cfg must be a psf.StashConfig, got {type(cfg).__name__}")
    if cfg.cuda_factor < 0 and cfg.capacity_factor is not None and cfg.paged_stash:
        raise ValueError(f"cuda_factor={cfg.cuda_factor} sizes the pools from rows a profiling "
                         f"pass observes, which a plan has not seen: plan with a factor >= 0")
    if dtype is None:
        first = next((p for p in getattr(model_or_config, "parameters", lambda: ())()), None)
        dtype = first.dtype if first is not None else torch.bfloat16
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype (torch.bfloat16, ...), got "
                         f"{dtype!r}")
    return config, family, dtype, cfg


def _sparse_count(model) -> tuple[int, int]:
    """``(MoE layers, dense layers)`` of a model (built on the meta device)."""
    from ._models import sparse_blocks
    sparse = len(sparse_blocks(model))
    return sparse, model.config.num_hidden_layers - sparse


def _activations(w, family, T, dtype, cfg, ep, counts) -> tuple[dict, int]:
    """``({kind: bytes kept at the end of forward}, the largest layer's capacity rows)``:
    each MoE layer ``moe{i}`` at its own capacity factor (`StashConfig.factor_for`), each
    dense layer's MLP, the rotary tables and the LM loss."""
    from ..core._routing import capacity_rows
    b, (sparse, dense) = dtype.itemsize, counts
    out = {"attention": 0, "routing": 0, "experts": 0, "stash_pools": 0, "mlp": 0}
    widest = 0
    for i in range(sparse):
        name = f"moe{i}"
        rows = capacity_rows(T, w["k"], cfg, ep, name).rows \
            if cfg.factor_for(name) is not None else T * w["k"]
        widest = max(widest, rows)
        stashed = cfg.paged_stash and cfg.factor_for(name) is not None
        for kind, size in _saved_per_layer(w, family, T, b, rows, stashed).items():
            out[kind] += size
    dense_layer = _saved_per_layer(w, family, T, b, 0, True)
    out["attention"] += dense * dense_layer["attention"] + T * w["head_dim"] * b  # + rotary
    # a dense layer: its norm's input and output, rstd, and its SwiGLU MLP's gate and up
    # outputs, silu's output and the product (down_proj's input)
    out["mlp"] = dense * (b * T * 2 * w["H"] + 4 * T + 4 * b * T * w["dense_ffn"])
    # the final norm's input, the loss's gradients kept from forward, the embedding's ids
    out["lm_loss"] = T * w["H"] * b * 2 + w["V"] * w["H"] * b + 8 * T
    return out, widest


def _moments(w, T, b, rows, weights, state, activations, optimizer_ws,
             held_pools) -> dict:
    """``{moment: {term: bytes alive then}}`` over a step (`MemoryPlan.at_peak` names).

    forward: the last layer's forward, everything before it kept. loss: the LM loss, its
    gradients made in forward (fp32 head gradient; a chunk's logits and their gradient, in
    the weights' dtype, as `cross_entropy_rows`'s kernel makes them on CUDA).
    backward: the top layer's backward, everything kept, the head's gradient and the layer's
    own. optimizer: every gradient and the optimizer's fp32 pieces (``optimizer_ws``); the
    pools too where the state holds them (``held_pools``).
    """
    H, V = w["H"], w["V"]
    head = V * H * b
    chunk = min(T, max(256, (1 << 27) // V))
    residual = 3 * T * H * b                                  # the stream's and norms' grads
    experts = rows * (2 * (2 * w["F"]) + w["F"] + 2 * H) * b  # popped rows, grads, z, fc1
    attention = T * (2 * w["q"] + 2 * w["kv"]) * b            # dq, dk, dv, do
    layer = residual + max(experts, attention)
    held = {"weights": weights, **state}
    kept = {f"activations.{k}": v for k, v in activations.items() if k != "lm_loss"}
    loss = {"activations.lm_loss": activations["lm_loss"]}
    pools = {"activations.stash_pools": activations["stash_pools"]} if held_pools else {}
    return {
        "forward": {**held, **kept, "workspace": layer},
        "loss": {**held, **kept, **loss, "workspace": max(4, b) * V * H + chunk * V * 2 * b},
        "backward": {**held, **kept,
                     "gradients": head + (weights - head) // w["L"], "workspace": layer},
        "optimizer": {**held, **pools, "gradients": weights, "workspace": optimizer_ws},
    }
