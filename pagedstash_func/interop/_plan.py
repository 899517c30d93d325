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
import math

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
        activations: ``{"attention", "experts", "routing", "stash_pools", "lm_loss"}``,
            what the step keeps for backward at the end of its forward.
        workspace: the largest transient on top of what is held at the peak's moment.
        peak: the predicted most allocated at once over forward, backward and the
            optimizer's step (weights and states included).
        peak_at: the moment of the peak (``"forward"``, ``"loss"``, ``"backward"``,
            ``"optimizer"``).
        host: host bytes of an offloaded optimizer (masters and moments).
        pinned_host: pinned host bytes (the offloaded optimizer's copy slots).
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
    host: int = 0
    pinned_host: int = 0

    def terms(self) -> dict:
        """The device terms by name (activations by kind), largest first."""
        out = {"weights": self.weights, "gradients": self.gradients, "master": self.master,
               "optimizer_state": self.optimizer_state, "workspace": self.workspace,
               **{f"activations.{k}": v for k, v in self.activations.items()}}
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def check(self, device_bytes: int) -> None:
        """`ValueError` naming what overflows if the peak exceeds ``device_bytes``.

        Args:
            device_bytes: the device's memory (``torch.cuda.mem_get_info()[1]``).

        Raises:
            ValueError: the peak exceeds it; the message names the largest terms and what
                would shrink each.
        """
        if self.peak <= device_bytes:
            return
        fix = {"optimizer_state": "offload=True keeps it on the host",
               "master": "offload=True keeps it on the host",
               "weights": "more ep ranks split the experts",
               "gradients": "more ep ranks split the experts' gradients",
               "activations.stash_pools": "a smaller cuda_factor, or host_factor > 0",
               "activations.experts": "paged_stash=True keeps only the valid rows",
               "activations.attention": "fewer tokens a step, or checkpoint_attention=True",
               "activations.lm_loss": "fewer tokens a step",
               "activations.routing": "fewer tokens a step",
               "workspace": ("offload=True steps a bucket at a time"
                             if self.peak_at == "optimizer" else "fewer tokens a step")}
        top = list(self.terms().items())[:3]
        named = "; ".join(f"{k} {v / GiB:.2f} GiB ({fix[k]})" for k, v in top)
        raise ValueError(f"the plan's peak, {self.peak / GiB:.2f} GiB at the {self.peak_at}, "
                         f"exceeds the device's {device_bytes / GiB:.2f} GiB by "
                         f"{(self.peak - device_bytes) / GiB:.2f} GiB; the largest terms: "
                         f"{named}")

    def table(self) -> str:
        """The plan as a printable table (GiB)."""
        rows = [f"{'term':<26}{'GiB':>9}"]
        rows += [f"{k:<26}{v / GiB:>9.3f}" for k, v in self.terms().items()]
        rows.append(f"{'peak (' + self.peak_at + ')':<26}{self.peak / GiB:>9.3f}")
        if self.host:
            rows.append(f"{'host (offloaded state)':<26}{self.host / GiB:>9.3f}")
            rows.append(f"{'pinned host':<26}{self.pinned_host / GiB:>9.3f}")
        return "\n".join(rows)


def _mesh_sizes(mesh) -> tuple[int, int]:
    """``(dp, ep)`` of a ``("dp", "ep")`` mesh, a process group (ep alone), ``None``, or a
    ``{"dp": n, "ep": m}`` dict of sizes (to plan for ranks not started)."""
    from ..parallel._mesh import ep_size, is_mesh
    if mesh is None:
        return 1, 1
    if isinstance(mesh, dict):
        if set(mesh) - {"dp", "ep"} or not all(isinstance(v, int) and not isinstance(v, bool)
                                                and v >= 1 for v in mesh.values()):
            raise ValueError(f"mesh as sizes is {{'dp': n, 'ep': m}} with positive integers, "
                             f"got {mesh!r}")
        return mesh.get("dp", 1), mesh.get("ep", 1)
    if is_mesh(mesh):
        return mesh["dp"].size(), mesh["ep"].size()
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
    """``(master bytes, state bytes, widest bucket)`` of ``sharded_optimizer``'s buckets:
    grouped by placement and dtype, cut by `bucketed`, each ``pieces_of`` its parameters
    (masters fp32, fp64 for fp64 parameters). AdamW's moments are two tensors like the
    master; torchao's 8-bit ones a byte an element, an fp32 scale a block and a 256-entry
    map, where the bucket is at least 4096 elements (else fp32, as torchao keeps them)."""
    from ..parallel._placement import EXPERTS
    from ..parallel._zero import bucketed, pieces_of
    block = 256 if optimizer == "adamw8bit" else 1
    groups: dict = {}
    for key, t, where in placed:
        groups.setdefault((where, t.dtype), []).append((key, t))
    masters = state = widest = 0
    for (where, dtype), members in groups.items():
        if offload or (dp, ep) == (1, 1):
            ranks = 1
        else:
            ranks = dp if where == EXPERTS else dp * ep
        for chunk in bucketed(members):
            _, width = pieces_of([t.numel() for _, t in chunk], ranks, block)
            size = 8 if dtype == torch.float64 else 4
            masters += width * size
            widest = max(widest, width)
            if block > 1 and width >= 4096:
                state += 2 * (width + 4 * (width // block) + 4 * 256)
            else:
                state += 2 * width * size
    return masters, state, widest


def _widths(config) -> dict:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    ffn = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return dict(H=config.hidden_size, heads=heads, head_dim=head_dim, q=heads * head_dim, kv=kv_heads * head_dim,
                kv_heads=kv_heads, E=experts, F=ffn, k=config.num_experts_per_tok,
                V=config.vocab_size, L=config.num_hidden_layers)


def _saved_per_layer(w: dict, family: str, T: int, b: int, rows: int, cfg) -> dict:
    """Bytes one decoder layer keeps for backward, by kind.

    attention: the input norm's input and output ``[T, H]``; the q, k projections before
    their norms (Qwen3-MoE, OLMoE); q and k after rotary and v (sdpa's inputs); sdpa's
    output (o_proj's input); fp32 norms' rstd and sdpa's logsumexp. routing: the MoE
    norm's input and output ``[T, H]``, its rstd, the router's fp32 softmax ``[T, E]``, the
    top-k ids and mask, psf's dispatch ids and weights. experts: the capacity buffers'
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
    experts = 0 if cfg.paged_stash else b * rows * (H + 2 * w["F"])
    return {"attention": attention, "routing": routing, "experts": experts}


def _pool_bytes(w: dict, T: int, dtype, cfg, group_size: int) -> int:
    """One layer's stash pools (device tier), as `pool_layouts` sizes them."""
    from ..stash._pools import moe_stash_specs, pool_layouts
    if not (cfg.capacity_factor is not None and cfg.paged_stash):
        return 0
    fake = {"w_gate_up": torch.empty(w["E"], w["H"], 2 * w["F"], dtype=dtype, device="meta")}
    specs = moe_stash_specs("moe0", fake, tokens=T, top_k=w["k"], cfg=cfg, dtype=dtype,
                            group_size=group_size)
    return sum(lay.cuda_pages * lay.page_bytes for lay in pool_layouts(specs, cfg))


def plan_memory(model_or_config, tokens: int, *, mesh=None, optimizer: str | None = "adamw",
                offload: bool = False, cfg=None, dtype=None) -> MemoryPlan:
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
        cfg: the step's `StashConfig` (default capacity 1.25, paged stash, pool per layer).
        dtype: the parameters' dtype (default bf16).

    Returns:
        A `MemoryPlan`; ``plan.check(device_bytes)`` raises what overflows.

    Raises:
        ValueError: an unsupported family, ``tokens`` not a positive integer, an unknown
            optimizer, ``offload`` with a mesh, experts that do not split over ``ep``.

    Example::

        plan = psf.plan_memory(config, 16384, offload=True)
        print(plan.table())
        plan.check(torch.cuda.mem_get_info()[1])
    """
    from ..core._config import StashConfig
    from ..core._routing import capacity_rows
    from ..parallel._offload import SLOTS
    from ..parallel._placement import placements
    config, family = _config_of(model_or_config)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive integer (per rank), got {tokens!r}")
    if optimizer not in (None, "adamw", "adamw8bit"):
        raise ValueError(f"optimizer must be 'adamw', 'adamw8bit' or None, got {optimizer!r}")
    if offload and optimizer != "adamw":
        raise ValueError("offload steps torch.optim.AdamW on the host: pass "
                         "optimizer='adamw' with offload=True")
    dp, ep = _mesh_sizes(mesh)
    if offload and (dp, ep) != (1, 1):
        raise ValueError("offload plans one process's whole state on its host: pass mesh=None "
                         "(a mesh shards the state instead)")
    cfg = cfg or StashConfig(capacity_factor=1.25, paged_stash=True, pool_scope="layer")
    dtype = dtype or torch.bfloat16
    tree, _ = _tree(config, ep, dtype)
    placed = placements(tree, ep)
    weights = sum(t.nbytes for _, t, _ in placed)
    masters, moments_all, widest = _optimizer_bytes(placed, dp, ep, offload, optimizer) \
        if optimizer else (0, 0, 0)
    w, b = _widths(config), dtype.itemsize
    rows = capacity_rows(tokens, w["k"], cfg, ep).rows if cfg.capacity_factor is not None \
        else tokens * w["k"]
    layer = _saved_per_layer(w, family, tokens, b, rows, cfg)
    pools = _pool_bytes(w, tokens, dtype, cfg, ep)
    head = w["V"] * w["H"] * b
    activations = {k: v * w["L"] for k, v in layer.items()}
    activations["attention"] += tokens * w["head_dim"] * b       # rotary's cos, shared
    activations["stash_pools"] = pools * w["L"]
    # the final norm's input, the loss's gradients kept from forward, the embedding's ids
    activations["lm_loss"] = tokens * w["H"] * b * 2 + head + 8 * tokens
    device_opt = 0 if offload else masters
    moments = 0 if offload else moments_all
    pinned = SLOTS * widest * (4 + b) if offload else 0
    layer_grads = (weights - head) // w["L"]
    moments_at, workspace = _moments(w, tokens, b, rows, weights, device_opt + moments,
                                     activations, layer_grads, masters,
                                     offload or (dp, ep) == (1, 1), optimizer)
    peak_at = max(moments_at, key=moments_at.get)
    return MemoryPlan(ranks={"dp": dp, "ep": ep}, tokens=tokens, weights=weights,
                      gradients=weights, master=device_opt, optimizer_state=moments,
                      activations=activations, workspace=workspace[peak_at],
                      peak=moments_at[peak_at], peak_at=peak_at,
                      host=masters + moments_all if offload else 0, pinned_host=pinned)


def _moments(w, T, b, rows, weights, state, activations, layer_grads, masters, streamed,
             optimizer):
    """``({moment: bytes alive}, {moment: its transient})`` over a step.

    forward: the last layer's forward, everything before it kept. loss: the LM loss, its
    gradients made in forward (fp32 head gradient, a chunk's fp32 logits and their cast).
    backward: the top layer's backward, everything kept, the head's gradient and the layer's
    own. optimizer: every gradient, and the optimizer's fp32 pieces: a bucket at a time
    where nothing is sharded (one in flight beside the one stepped), every bucket's at
    once where ranks share the state (clipping reads them all), and one bucket's rows.
    """
    from ..parallel._zero import BUCKET_BYTES
    H, V = w["H"], w["V"]
    held = weights + state
    kept = sum(activations.values()) - activations["lm_loss"]
    head = V * H * b
    chunk = min(T, max(256, (1 << 27) // V))
    residual = 3 * T * H * b                                  # the stream's and norms' grads
    experts = rows * (2 * (2 * w["F"]) + w["F"] + 2 * H) * b  # popped rows, grads, z, fc1
    attention = T * (2 * w["q"] + 2 * w["kv"]) * b            # dq, dk, dv, do
    layer = residual + max(experts, attention)
    bucket = min(BUCKET_BYTES, 4 * (weights // b))
    alive = {"forward": held + kept,
             "loss": held + kept + activations["lm_loss"],
             "backward": held + kept + head,
             "optimizer": held + weights}
    transient = {"forward": layer,
                 "loss": 4 * V * H + chunk * V * (4 + b),
                 "backward": layer + layer_grads,
                 "optimizer": 0 if not optimizer else (
                     2 * bucket if streamed else masters + bucket)}
    return {k: alive[k] + transient[k] for k in alive}, transient
