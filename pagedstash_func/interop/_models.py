"""Whole transformers causal LMs through `psf.moe`: ``params, loss_fn = from_hf_model(model)``.

``loss_fn(params, batch)`` runs the model itself (embeddings, attention, norms, dense MLPs, the
LM head and its loss) through ``torch.func.functional_call``, with every sparse MoE block
computed by `psf.moe` from ``params``; the result equals ``model(**batch).loss``. Families are
accepted only where the sparse block's math is exactly `psf.moe`'s.

One copy of every tensor: the dense entries of ``params`` are the model's own parameters
(aliases, no copy), and the model's expert tensors are replaced by views of ``params``' expert
tensors (psf's layout is their transpose), so neither layout is kept beside the other. An
in-place optimizer step on ``params`` therefore updates the model too.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from ..core import _frame
from ..core._router import route_with, router_stats
from ..layer._aux import load_balancing_loss
from ..layer._moe import moe
from ..layer._norm import rms_norm
from ..parallel._placement import ExpertShard, HFStateDict, placements
from ._blocks import SUPPORTED, check_hf_block, hf_moe_kwargs, shared_module
from ._lm_loss import IGNORE, chunk_rows, lm_loss
from ._masking import ACTIVE, causal_without_padding, unpacked_positions
from ._watch import ModelWatch

FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3")
# the families whose *ForCausalLM adds router_aux_loss_coef * load_balancing_loss_func(...) to
# its loss when config.output_router_logits is set (DeepSeek-V3 records the logits, adds none)
AUX_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")
# What each refused family computes beyond psf.moe's router and SwiGLU experts.
DIFFERS = {
    "deepseek_v2": "group-limited routing, routed_scaling_factor and shared experts",
    "qwen3_next": "a gated shared expert and linear-attention layers",
    "jamba": "Mamba layers and its own router",
    "granitemoe": "a router with its own normalisation",
    "dbrx": "its own expert layout and router normalisation",
    "phimoe": "sparsemixer routing",
    "gpt_oss": "biases on experts and router, and a clamped SwiGLU",
}


_LOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _lock_of(model) -> threading.Lock:
    """One lock per model: two threads may not run a loss on one model at once."""
    with _LOCKS_GUARD:
        if model not in _LOCKS:
            _LOCKS[model] = threading.Lock()
        return _LOCKS[model]


def from_hf_model(model, *, loss_chunk: int | None = 0, fused_norms: bool = True,
                  checkpoint_attention: bool = False, group=None):
    """``(params, loss_fn)`` for a transformers 5 MoE causal LM.

    The families are Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE and DeepSeek-V3.

    Args:
        model: a ``transformers`` ``*ForCausalLM`` whose sparse blocks are
            ``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``, ``OlmoeSparseMoeBlock``,
            ``Qwen2MoeSparseMoeBlock`` or ``DeepseekV3MoE`` (dense layers between them, as
            Qwen3-MoE's ``mlp_only_layers`` makes, stay dense). Put it on its device and dtype
            first: ``params`` alias its tensors.
        loss_chunk: the LM head and its cross-entropy run in chunks of this many rows, each
            chunk's logits freed before the next (0: about 128M logits a chunk; the default),
            so the full ``[B*S, V]`` logits never exist; the loss equals transformers' to fp32
            rounding. ``None`` runs the model's own head and loss (``model(..., labels=...)``).
        fused_norms: the model's RMSNorms run as `psf.rms_norm` while the loss runs (the same
            formula to fp32 rounding, one kernel each way, keeping one fp32 scale per row for
            backward instead of two fp32 copies of the rows); ``False`` runs the model's own.
        checkpoint_attention: each decoder layer's attention block keeps only its input for
            backward and runs its forward again there (``torch.utils.checkpoint``); the MoE
            blocks, whose pages the stash already holds, are not recomputed. Plain autograd
            only: `run_step`, `psf.graphed` and `psf.value_and_grad` take it, ``torch.func``
            transforms refuse it (a `ValueError` says so). ``loss_fn.checkpoint_attention``
            switches it later.
        group: a process group or a ``("dp", "ep")`` ``DeviceMesh`` to shard every sparse
            block's experts over (its ``ep`` dim): each rank keeps experts
            ``[r E/R, (r+1) E/R)`` (``params[prefix]`` an `ExpertShard`, the model's expert
            Parameters holding that shard alone, so the model runs only through ``loss_fn``),
            the rest is replicated. Every rank must pass the same model (same seed or weights);
            reduce the gradients with `psf.reduce_gradients` ``(grads, group)``.

    Returns:
        ``(params, loss_fn)``:

            ``params``: a dict of floating-point tensors, every parameter of the model under
            its own name, except that each sparse block ``prefix`` (e.g.
            ``"model.layers.0.mlp"``) becomes ``params[prefix] = {"router" [E, H],
            "w_gate_up" [E, H, 2F], "w_down" [E, F, H]}`` in psf's layout (with
            ``"router_bias"`` where the gate has one). Tied weights appear once, under the
            name ``model.named_parameters()`` gives them.

            ``loss_fn(params, batch) -> (loss, {"tokens": n})``, ``loss`` a 0-d fp32 tensor
            (fp64 for an fp64 model) and ``n`` a 0-d int64 tensor, on the model's device:
            ``batch`` holds ``input_ids`` ``[B, S]`` int64, ``labels`` ``[B, S]`` (``-100``
            where nothing is predicted) and optionally ``attention_mask``: ``[B, S]`` (1 keep,
            0 padding), or a prepared bool ``[B, 1, S, S]`` mask (True: attend) that
            transformers uses as it is, where a token that does not attend to itself is
            padding. A ``[B, S]`` mask makes transformers' mask code read the device on the
            host, once per forward; a prepared 4-D mask or none does not, so a capacity step
            then syncs nowhere. ``loss`` equals ``model(**batch).loss``; ``n`` counts the
            labels that enter it (weights for gradient accumulation). Masked positions are
            routed to padding (no capacity, no pages, no expert output), so a position that is
            masked must not feed the loss: its label must be ``-100`` and so must the label
            after it; a batch where either is not is refused with a `ValueError` (on the
            capacity path by the runner's one flag read).

    Raises:
        ValueError: naming the family for a model whose sparse blocks psf does not compute
            exactly, and naming the setting for router jitter or attention dropout (and for
            other settings it does not compute: activation checkpointing, an LM head with a
            bias under ``loss_chunk``, non-floating-point parameters, experts that do not
            split over ``group``).
        TypeError: ``model`` is not a ``torch.nn.Module``.

    Example::

        model = transformers.AutoModelForCausalLM.from_config(config)
        params, loss_fn = psf.from_hf_model(model)
        step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=1.25))
        res = psf.run_step(step, params, batch, step.init(params, batch))
    """
    blocks = sparse_blocks(model)
    _check_model(model)
    if loss_chunk is not None and (not isinstance(loss_chunk, int) or isinstance(loss_chunk, bool)
                                   or loss_chunk < 0):
        raise ValueError(f"loss_chunk must be a whole number of rows (0: automatic) or None, "
                         f"got {loss_chunk!r}")
    head = model.get_output_embeddings()
    if loss_chunk is not None and getattr(head, "bias", None) is not None:
        raise ValueError("the LM head has a bias, which the chunked loss does not add: pass "
                         "loss_chunk=None")
    inside = _routed_prefixes(blocks)
    odd = [n for n, p in model.named_parameters() if not p.is_floating_point()]
    if odd:
        raise ValueError(f"parameters {odd[:3]} are not floating-point: from_hf_model's params "
                         f"are floating-point tensors only")
    block_of = {prefix: (block, hf_moe_kwargs(block)) for prefix, block in blocks.items()}
    params = {name: p.detach() for name, p in model.named_parameters()
              if not name.startswith(inside)}
    built = _built_shard(model, block_of, group)
    if group is not None:
        from ..parallel._mesh import ep_group
        group = ep_group(group)
    if group is not None and built is None:    # refused before the model changes
        from ..parallel._mesh import check_experts_split
        check_experts_split(next(iter(blocks.values())).experts.gate_up_proj.shape[0],
                            torch.distributed.get_world_size(group))
    for prefix, (block, _) in block_of.items():        # the model changes from here on
        params[prefix] = _adopt_block(block)
        if built is not None and built[1] > 1:          # built on this rank's shard
            params[prefix] = ExpertShard(params[prefix])
        elif group is not None and built is None:
            params[prefix] = _keep_shard(block, params[prefix], group)
    names = {id(p): n for n, p in model.named_parameters()}
    head_name = names[id(head.weight)]
    if not isinstance(fused_norms, bool):
        raise ValueError(f"fused_norms must be True or False, got {fused_norms!r}")
    norms = _norms(model) if fused_norms else ()
    loss_fn = _LossFn(model, block_of, tuple(n for n in params if n not in blocks), head_name,
                      loss_chunk, norms)
    loss_fn.checkpoint_attention = checkpoint_attention
    loss_fn.group = group
    return params, loss_fn


def _built_shard(model, block_of, group):
    """``(rank, ranks)`` of a model `from_hf_config` built on one rank's experts (checked
    against ``group``), or None for a whole model; a model already holding a shard otherwise
    (through ``from_hf_model(model, group=...)`` once) is refused."""
    built = getattr(model, "_psf_shard", None)
    if built is not None:
        from ..parallel._mesh import ep_position
        here = ep_position(group)
        if here != tuple(built):
            raise ValueError(f"this model was built by from_hf_config with the experts of rank "
                             f"{built[0]} of {built[1]}, and this group makes it rank "
                             f"{here[0]} of {here[1]}: pass the group it was built for")
        return tuple(built)
    sharded = [prefix for prefix, (block, _) in block_of.items()
               if block.experts.gate_up_proj.shape[0] != block.gate.weight.shape[0]]
    if sharded:
        raise ValueError(f"{sharded[0]}'s experts hold a shard of the router's experts (this "
                         f"model went through from_hf_model(model, group=...) already, which "
                         f"keeps this rank's experts alone): build or load the model again and "
                         f"call from_hf_model on it once")
    return None


def _keep_shard(block, adopted, group):
    """`shard_experts` of ``adopted``; the block's expert Parameters come to hold views of
    that shard (the other experts are freed)."""
    from ..parallel._expert_parallel import shard_experts
    with torch.no_grad():
        shard = shard_experts(adopted, group)
        block.experts.gate_up_proj.data = shard["w_gate_up"].transpose(1, 2)
        block.experts.down_proj.data = shard["w_down"].transpose(1, 2)
    return shard


def _attention_blocks(model) -> tuple:
    """Each decoder layer's attention module (``layers[i].self_attn``)."""
    found = tuple(m for name, m in model.named_modules() if name.endswith(".self_attn"))
    if not found:
        raise ValueError(f"checkpoint_attention: {type(model).__name__} has no "
                         f"layers[i].self_attn modules to checkpoint")
    return found


def _checkpointed_forward(module, norms):
    """The attention block's own forward under ``torch.utils.checkpoint`` (non-reentrant):
    its input kept, its activations recomputed in backward. The recompute runs after the
    loss has returned, so it must not read the module's attributes as they are then: the
    weights go in as inputs (the ones the forward saw) and the block's norms are patched
    again for it."""
    forward = type(module).forward
    names = [n for n, _ in module.named_parameters()]
    inner = [m for m in module.modules() if m in norms]

    def run(weights, args, kwargs):
        with torch.nn.utils.stateless._reparametrize_module(module, dict(zip(names, weights))), \
                _patched_norms(inner):
            return forward(module, *args, **kwargs)

    def checkpointed(*args, **kwargs):
        if torch._C._functorch.maybe_current_level() is not None:
            raise ValueError("checkpoint_attention recomputes the attention blocks with "
                             "torch.utils.checkpoint, which torch.func transforms refuse: step "
                             "with psf.run_step, psf.graphed or psf.value_and_grad, or build "
                             "the loss with checkpoint_attention=False")
        if not torch.is_grad_enabled():
            return forward(module, *args, **kwargs)
        weights = [_attribute(module, n) for n in names]
        return torch.utils.checkpoint.checkpoint(run, weights, args, kwargs,
                                                 use_reentrant=False)
    return checkpointed


def _attribute(module, dotted):
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


@contextlib.contextmanager
def _patched_norms(norms):
    before = [(n, n.__dict__.get("forward")) for n in norms]
    try:
        for n in norms:
            n.forward = _norm_forward(n)
        yield
    finally:
        for n, old in before:
            if old is None:
                n.__dict__.pop("forward", None)
            else:
                n.forward = old


# The norms whose forward is, op for op, psf.rms_norm's formula (read from each family's
# modeling file): w * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype).
NORMS = ("MixtralRMSNorm", "Qwen3MoeRMSNorm", "OlmoeRMSNorm", "Qwen2MoeRMSNorm",
         "DeepseekV3RMSNorm")


def _norms(model) -> tuple:
    """The model's RMSNorm modules that `psf.rms_norm` computes (see `NORMS`)."""
    return tuple(m for m in model.modules() if type(m).__name__ in NORMS
                 and isinstance(getattr(m, "weight", None), torch.Tensor)
                 and m.weight.dim() == 1 and hasattr(m, "variance_epsilon"))


def _norm_forward(module):
    def forward(hidden_states):
        return rms_norm(hidden_states, module.weight, module.variance_epsilon)
    return forward


def to_hf_state_dict(tree, model) -> dict:
    """A tree shaped like `from_hf_model`'s ``params`` under the model's own names and layouts.

    Expert tensors come back as views in transformers' layout (``gate_up_proj [E, 2F, H]``,
    ``down_proj [E, H, F]``); no tensor is copied.

    Args:
        tree: `from_hf_model`'s ``params``, or a tree shaped like them (their gradients).
        model: the model ``tree`` was built from.

    Returns:
        An `HFStateDict`: ``{name: tensor}`` for every parameter of ``model`` (tied names
            each get the shared tensor), ready for ``model.load_state_dict(...)`` or
            ``save_pretrained``, recording which names hold an expert shard (where ``tree``'s
            sparse blocks are `ExpertShard`s), so that `psf.save_checkpoint` and
            `psf.reduce_gradients` treat them as such.

    Raises:
        TypeError: ``tree`` is not a dict.
        ValueError: ``tree`` lacks a parameter of ``model``, holds one it does not have, a
            sparse block's entry is not ``router``, ``w_gate_up`` and ``w_down``, or is an
            expert shard in a plain dict (its record lost).
    """
    if not isinstance(tree, dict):
        raise TypeError(f"to_hf_state_dict needs the dict from_hf_model returned (or one shaped "
                        f"like it), got {type(tree).__name__}")
    blocks = sparse_blocks(model)
    out, experts = {}, []
    for prefix in blocks:
        sub = tree.get(prefix)
        if not isinstance(sub, dict) or not {"router", "w_gate_up", "w_down"} <= set(sub) \
                or set(sub) - {"router", "w_gate_up", "w_down", "router_bias"}:
            raise ValueError(f"tree[{prefix!r}] must hold router, w_gate_up and w_down (the "
                             f"sparse block in psf's layout), got "
                             f"{sorted(sub) if isinstance(sub, dict) else type(sub).__name__}")
        if isinstance(sub, ExpertShard):          # the shard's record goes with its names
            experts += [f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"]
        else:
            placements({prefix: sub})             # refuses a shard that lost its record
        out[f"{prefix}.gate.weight"] = sub["router"]
        out[f"{prefix}.experts.gate_up_proj"] = sub["w_gate_up"].transpose(1, 2)
        out[f"{prefix}.experts.down_proj"] = sub["w_down"].transpose(1, 2)
        if "router_bias" in sub:                      # a buffer: saved with the weights
            out[f"{prefix}.gate.e_score_correction_bias"] = sub["router_bias"]
    canonical = dict(model.named_parameters())
    every = dict(model.named_parameters(remove_duplicate=False))
    by_id = {id(p): n for n, p in canonical.items()}
    inside = _routed_prefixes(blocks)
    missing = []
    for name, p in every.items():
        if name.startswith(inside):
            continue
        key = by_id[id(p)]
        if key not in tree:
            missing.append(key)
        else:
            out[name] = tree[key]
    if missing:
        raise ValueError(f"the tree lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}: "
                         f"pass the dict from_hf_model returned for this model (or its grads)")
    extra = set(tree) - set(canonical) - set(blocks)
    if extra:
        raise ValueError(f"the tree holds {sorted(extra)[:4]}, which are not parameters of this "
                         f"model: was it built from another model?")
    return HFStateDict(out, experts)


class _LossFn:
    """``loss_fn(params, batch) -> (loss, {"tokens": n})`` of `from_hf_model`. Carries its
    identity (the model's class and config) for step files."""

    def __init__(self, model, blocks, dense_names, head_name, loss_chunk, norms=()):
        self.model, self.blocks, self.dense_names = model, blocks, dense_names
        self.norms, self.attention = norms, ()
        self.num_experts = int(next(iter(blocks.values()))[0].gate.weight.shape[0])
        self.group = None         # the expert-parallel group (from_hf_model(group=...))
        self.watch = ModelWatch(model, blocks)           # what the params were taken from
        self.head_name = head_name
        self.chunk = None if loss_chunk is None else (
            loss_chunk or chunk_rows(model.get_output_embeddings().weight.shape[0]))
        self.base_prefix = model.base_model_prefix
        self._held_by, self._patches = None, (None, [])   # the thread holding it
        self.__qualname__ = f"from_hf_model({type(model).__name__})"
        self.__module__ = __name__

    @property
    def checkpoint_attention(self) -> bool:
        """Whether the attention blocks are recomputed in backward (read at every call; set
        it to switch, as ``from_hf_model(..., checkpoint_attention=...)`` does)."""
        return bool(self.attention)

    @checkpoint_attention.setter
    def checkpoint_attention(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"checkpoint_attention must be True or False, got {value!r}")
        self.attention = _attention_blocks(self.model) if value else ()

    def __psf_identity__(self):
        """What this loss computes, for step files: the model's class and config, the names
        of its parameters and sparse blocks, the LM loss's chunking, and the settings the
        config's JSON leaves out but the forward reads: train or eval mode (dropout) and the
        attention implementation."""
        config = self.model.config
        return (type(self.model).__qualname__, config.to_json_string(use_diff=False),
                self.dense_names, tuple(self.blocks), self.chunk, bool(self.model.training),
                str(getattr(config, "_attn_implementation", None)), len(self.norms),
                len(self.attention), self.group)

    def __call__(self, params, batch):
        ids, labels, mask = _read_batch(batch)
        keep = None
        if mask is not None:
            keep = _routing_keep(mask, labels, self.num_experts)
        kwargs = {"input_ids": ids, "use_cache": False}
        if mask is not None:
            kwargs["attention_mask"] = mask
        tokens = (labels[:, 1:] != IGNORE).sum()
        config = self.model.config
        aux = bool(getattr(config, "output_router_logits", False))
        if hasattr(config, "output_router_logits"):
            kwargs["output_router_logits"] = False        # the aux loss is added below
        stats = [] if aux and config.model_type in AUX_FAMILIES else None
        with self._routed(params, keep, stats):
            if self.chunk is None:
                dense = {n: params[n] for n in self.dense_names}
                out = torch.func.functional_call(self.model, dense, args=(),
                                                 kwargs={**kwargs, "labels": labels},
                                                 strict=False)
                return self._with_aux(out.loss, stats), {"tokens": tokens}
            cut = len(self.base_prefix) + 1
            dense = {n[cut:]: params[n] for n in self.dense_names
                     if n.startswith(f"{self.base_prefix}.")}
            base = getattr(self.model, self.base_prefix)
            hidden = torch.func.functional_call(base, dense, args=(), kwargs=kwargs,
                                                strict=False).last_hidden_state
        targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE)
        loss = lm_loss(hidden.reshape(-1, hidden.shape[-1]), params[self.head_name],
                       targets.reshape(-1), self.chunk)
        return self._with_aux(loss, stats), {"tokens": tokens}

    def _with_aux(self, loss, stats):
        """transformers' total loss: the LM loss plus ``router_aux_loss_coef`` times its
        load-balancing loss over the sparse blocks (padding excluded), where asked."""
        if not stats:
            return loss
        # the model's own attribute, as its forward reads it (set from the config at build)
        coef = float(getattr(self.model, "router_aux_loss_coef",
                             self.model.config.router_aux_loss_coef))
        return loss + coef * load_balancing_loss(stats).to(loss.dtype)

    def _check_still_adopted(self) -> None:
        """The model must still be the one ``params`` were taken from: the same parameter
        tensors (and DeepSeek-V3 score-correction biases) in the same memory, the same
        routing settings of every sparse block, and the settings from_hf_model accepted (each
        cheap to check, so checked at every call)."""
        _check_model(self.model, [block for block, _ in self.blocks.values()])
        change = self.watch.change()
        if change is not None:
            again = "call psf.from_hf_model(model) again after them" if self.group is None \
                else ("build or load the model again (its experts now hold this rank's shard "
                      "alone) and call psf.from_hf_model(model, group=...) on it")
            raise ValueError(
                f"the model changed since psf.from_hf_model took its params: {change}. psf "
                f"would train tensors the model no longer uses (and save_pretrained write "
                f"stale ones). Make changes to the model (resizing embeddings, a new head or "
                f"Parameter, load_state_dict(assign=True), .data =, .to(...), routing "
                f"settings) before from_hf_model, or {again} (a weight changed in place, "
                f"through params or the model, needs nothing: the two share it)")

    @contextlib.contextmanager
    def _routed(self, params, keep, stats=None):
        if torch.compiler.is_compiling():   # the host part is `held`, outside the graph
            if self._held_by is None:
                raise ValueError(
                    "torch.compile over a from_hf_model loss: compile the step with "
                    "psf.compile(psf.stash_aware(loss_fn, cfg)), which holds the model (its "
                    "lock, its checks, its patched blocks) outside the compiled graph")
            hold = contextlib.nullcontext()
        else:
            if ACTIVE.value is not None:
                raise RuntimeError("a from_hf_model loss is already running in this thread (a "
                                   "loss_fn called from inside another's forward)")
            # held already where psf.compile holds it and left a part of its graph to eager
            hold = contextlib.nullcontext() if self._held_by == threading.get_ident() \
                else self.held()
        with hold:
            ACTIVE.value = (params, keep, stats)
            try:
                yield
            finally:
                ACTIVE.value = None

    @contextlib.contextmanager
    def held(self):
        """The host side of a call, held for a block: the model's lock, the check that it is
        still the model the params came from, and its sparse blocks (and norms, attention)
        running psf's forwards. A call runs inside it; `psf.compile` holds it around its
        compiled graph, which cannot take a lock or patch a module. The patched forwards are
        made once per loss, so a compiled graph sees the same functions every step."""
        lock = _lock_of(self.model)
        if not lock.acquire(blocking=False):
            raise RuntimeError("a from_hf_model loss is running on this model in another "
                               "thread: the model's modules are swapped while it runs, so "
                               "give each thread a model of its own")
        patched = []
        try:
            # checked while this call holds the model: another thread's forward swaps params
            # into the modules, which would look like a changed model
            self._check_still_adopted()
            for module, forward in self._forwards(self.group):
                patched.append((module, module.__dict__.get("forward")))
                module.forward = forward
            unpacked_positions()
            causal_without_padding()
            self._held_by = threading.get_ident()
            yield
        finally:
            self._held_by = None
            for module, before in patched:
                if before is None:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = before
            lock.release()

    def _forwards(self, group) -> list:
        """``(module, forward)`` of every module psf runs while a call holds the model."""
        key = (group, self.attention)
        if self._patches[0] != key:
            made = [(block, _block_forward(prefix, kw, block, group))
                    for prefix, (block, kw) in self.blocks.items()]
            made += [(norm, _norm_forward(norm)) for norm in self.norms]
            made += [(a, _checkpointed_forward(a, set(self.norms))) for a in self.attention]
            self._patches = (key, made)
        return self._patches[1]


def _block_forward(prefix, kw, block, group=None):
    """The forward that replaces one sparse block while a loss runs: `psf.moe` on its params
    (the router and the routed experts), with masked tokens routed to padding, plus the
    block's own shared expert module (its weights are dense params, swapped in by
    ``functional_call``); with ``output_router_logits`` the router's statistics are kept for
    the aux loss."""
    top_k, router = kw["top_k"], kw["router"]
    mlp, gate = shared_module(block)

    def forward(hidden_states):
        params, keep, stats = ACTIVE.value
        p = params[prefix]
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        routing = None
        if keep is not None or stats is not None:
            ids, weights, logits = route_with(p["router"], x, top_k, router,
                                              p.get("router_bias"))
            if keep is not None:
                ids = torch.where(keep[0][:, None], ids, keep[1][:, None])
            routing = (ids, weights)
            if stats is not None:
                stats.append(router_stats(logits, ids, None if keep is None else keep[0]))
        if routing is not None:             # routed above: the bias has been used there
            p = {k: v for k, v in p.items() if k != "router_bias"}
        y = moe(p, x, top_k=top_k, routing=routing,
                router=None if routing is not None else router, group=group)
        if mlp is not None:
            shared = mlp(x)
            if gate is not None:
                shared = torch.sigmoid(gate(x)) * shared
            y = y + shared
        return y.reshape(shape)

    return forward


def _routed_prefixes(blocks) -> tuple:
    """Name prefixes of the parameters psf.moe computes from (each block's router and
    routed experts); a shared expert stays a dense module of the model."""
    return tuple(f"{p}.{part}." for p in blocks for part in ("gate", "experts"))


def _routing_keep(mask, labels, num_experts):
    """``(keep [T] bool, pad id [T])``: masked tokens take id ``-1`` (padding); a masked token
    that feeds the loss takes ``E + 1``, which the capacity path flags as a bad id (no host
    read) and the exact path never reaches, since it checks the labels first."""
    seen = None
    if mask.ndim == 4:          # a prepared mask: padding is a token that does not see itself
        seen = mask[:, 0].any(dim=1)                              # [B, S]: someone attends to it
        mask = mask[:, 0].diagonal(dim1=-2, dim2=-1)
    keep = mask.reshape(-1).to(torch.bool)
    masked = ~mask.to(torch.bool)
    feeds = masked & (labels != IGNORE)                       # a masked label in the loss
    if seen is not None:
        feeds |= masked & seen                # a masked token that later tokens attend to
    feeds[:, :-1] |= masked[:, :-1] & (labels[:, 1:] != IGNORE)   # a masked logit in the loss
    frame = _frame.current()
    if frame is None or frame.mode != "capacity":
        _check_labels(feeds)
    pad = torch.where(feeds.reshape(-1), num_experts + 1, -1)
    return keep, pad


def _check_labels(feeds) -> None:
    if bool(feeds.any()):
        b, s = (int(i) for i in feeds.nonzero()[0])
        raise ValueError(
            f"position [{b}, {s}] is masked by attention_mask but feeds the loss (its label, or "
            f"the label after it, is not -100, or, in a 4-D mask, a token attends to it): psf "
            f"routes masked tokens to padding, where transformers runs the experts on them. Set "
            f"labels to -100 at masked positions and at the position after a masked one (left "
            f"padding: the first real token), and let no token attend to a masked one")


def _read_batch(batch):
    if not isinstance(batch, dict):
        raise TypeError(f"batch must be a dict with input_ids and labels, got "
                        f"{type(batch).__name__}")
    unknown = set(batch) - {"input_ids", "labels", "attention_mask"}
    missing = {"input_ids", "labels"} - set(batch)
    if missing or unknown:
        raise ValueError(f"batch must hold input_ids, labels and optionally attention_mask; "
                         f"missing {sorted(missing)}, unknown {sorted(unknown)}")
    ids, labels, mask = batch["input_ids"], batch["labels"], batch.get("attention_mask")
    for name, t in (("input_ids", ids), ("labels", labels), ("attention_mask", mask)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"batch[{name!r}] must be a tensor, got {type(t).__name__}")
    if isinstance(labels, torch.Tensor) and labels.dtype != torch.int64:
        raise ValueError(f"batch['labels'] must be int64 token ids (-100: ignored), as "
                         f"transformers' loss takes them; got {labels.dtype}")
    if isinstance(mask, torch.Tensor) and mask.ndim == 4:
        b, s = ids.shape if isinstance(ids, torch.Tensor) and ids.ndim == 2 else (None, None)
        if mask.dtype != torch.bool or tuple(mask.shape) != (b, 1, s, s):
            raise ValueError(f"a 4-D batch['attention_mask'] must be bool [B, 1, S, S] = "
                             f"[{b}, 1, {s}, {s}], got {mask.dtype} {list(mask.shape)}")
    for name, t in (("input_ids", ids), ("labels", labels), ("attention_mask", mask)):
        if t is None or (name == "attention_mask" and t.ndim == 4):
            continue
        if not isinstance(t, torch.Tensor) or t.ndim != 2 or t.is_floating_point():
            raise ValueError(f"batch[{name!r}] must be an integer tensor [B, S], got "
                             f"{getattr(t, 'dtype', type(t).__name__)} "
                             f"{list(getattr(t, 'shape', []))}")
        if t.shape != ids.shape:
            raise ValueError(f"batch[{name!r}] has shape {list(t.shape)}, input_ids "
                             f"{list(ids.shape)}: they must match")
    return ids, labels, mask


def sparse_blocks(model) -> dict:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"from_hf_model needs a transformers model, got {type(model).__name__}")
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in FAMILIES:
        why = DIFFERS.get(family)
        why = f"computes {why}" if why else "is not a family psf.moe has been checked against"
        raise ValueError(f"from_hf_model supports {', '.join(FAMILIES)}; {family!r} "
                         f"({type(model).__name__}) {why}")
    blocks = {n: m for n, m in model.named_modules() if type(m).__name__ in SUPPORTED}
    odd = [n for n, m in model.named_modules()
           if type(m).__name__.endswith("SparseMoeBlock") and n not in blocks]
    if odd:
        raise ValueError(f"{family} model has sparse blocks psf does not compute: {odd[:3]}")
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no sparse MoE block (num_experts=0, or "
                         f"every layer in mlp_only_layers): nothing for psf.moe to compute")
    return blocks


def _check_model(model, blocks=None) -> None:
    """`ValueError` naming a setting psf does not compute; ``blocks``: the sparse blocks
    already found (the per-call check skips walking every module again)."""
    cfg = model.config
    if model.training and getattr(cfg, "attention_dropout", 0.0):
        raise ValueError(f"attention_dropout={cfg.attention_dropout} draws from torch's global "
                         f"generator, so a rerun or a replay would see other numbers: set it to "
                         f"0 or call model.eval()")
    for m in blocks if blocks is not None else model.modules():
        if type(m).__name__ in SUPPORTED:
            check_hf_block(m)
    # transformers >= 5.24 names it is_activation_checkpointing and warns on the old name:
    # read the old one only where the new one does not exist
    name = next((a for a in ("is_activation_checkpointing", "is_gradient_checkpointing")
                 if hasattr(type(model), a) or a in vars(model)), None)
    if name is not None and getattr(model, name, False):
        off = "activation_checkpointing_disable" if hasattr(
            model, "activation_checkpointing_disable") else "gradient_checkpointing_disable"
        raise ValueError(f"activation (gradient) checkpointing recomputes transformers' whole "
                         f"decoder layers in backward, psf.moe and its stash included: call "
                         f"model.{off}(), and for the attention blocks alone build the loss "
                         f"with from_hf_model(model, checkpoint_attention=True)")
    if not hasattr(model, "lm_head"):
        raise ValueError(f"{type(model).__name__} has no lm_head: from_hf_model needs a "
                         f"*ForCausalLM model (its loss is the LM loss)")


def _adopt_block(block) -> dict:
    """The block's tensors in psf's layout; the block's own expert Parameters (the same
    objects, so an optimizer or hook that holds them keeps working) come to hold views of them,
    so the model and ``params`` share one copy (the old layout is freed)."""
    experts = block.experts
    with torch.no_grad():
        gate_up = experts.gate_up_proj.detach().transpose(1, 2).contiguous()   # [E, H, 2F]
        down = experts.down_proj.detach().transpose(1, 2).contiguous()         # [E, F, H]
        experts.gate_up_proj.data = gate_up.transpose(1, 2)
        experts.down_proj.data = down.transpose(1, 2)
    out = {"router": block.gate.weight.detach(), "w_gate_up": gate_up, "w_down": down}
    bias = getattr(block.gate, "e_score_correction_bias", None)
    if bias is not None:          # a buffer of the model: chosen with, not trained
        out["router_bias"] = bias
    return out




def pad_to_bucket(batch: dict, buckets) -> dict:
    """An LM batch right-padded along ``S`` to the smallest of ``buckets`` that holds it.

    Batches of varying length then take a few fixed shapes (one `step.init` state each). The
    new positions are masked (``attention_mask`` 0), hold ``input_ids`` 0 and ``labels`` -100:
    a `from_hf_model` loss routes them to padding (no capacity, no pages) and gives the loss
    and gradients of the unpadded batch.

    Args:
        batch: ``input_ids`` ``[B, S]``, ``labels`` ``[B, S]``, optionally a ``[B, S]``
            ``attention_mask``.
        buckets: the sequence lengths a batch may take (positive ints).

    Returns:
        A new dict of ``input_ids``, ``labels`` and ``attention_mask``, each ``[B, bucket]``.

    Raises:
        ValueError: no bucket holds ``S``, ``buckets`` are not positive lengths, or a 4-D
            mask (pad it yourself: its shape is the caller's).
    """
    ids, labels, mask = _read_batch(batch)
    if mask is not None and mask.ndim == 4:
        raise ValueError("pad_to_bucket pads [B, S] masks; a prepared 4-D mask is yours to "
                         "pad")
    sizes = sorted(int(b) for b in buckets)
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(f"buckets must be positive sequence lengths, got {buckets!r}")
    seq = ids.shape[1]
    fit = next((b for b in sizes if b >= seq), None)
    if fit is None:
        raise ValueError(f"a batch of {seq} tokens a row is longer than the largest bucket "
                         f"({sizes[-1]}): add a bucket, or cut the batch")
    extra = fit - seq
    if mask is None:
        mask = torch.ones_like(ids)
    pad = torch.nn.functional.pad
    return {"input_ids": pad(ids, (0, extra), value=0),
            "labels": pad(labels, (0, extra), value=IGNORE),
            "attention_mask": pad(mask, (0, extra), value=0)}
