"""`from_hf_config`: a transformers MoE model built on each rank's own shard of the experts.

``from_hf_model(model, group=...)`` needs every rank to hold the whole model first; for a
Qwen3-30B-A3B that is about 61 GB of bf16 per rank before sharding. Here the model is built by
transformers' own code (``AutoModelForCausalLM.from_config``), every replicated tensor as it
makes it, but each sparse block's expert tensors stand in as `_ExpertDraws`: tensors of the
full shape that hold no memory and keep only this rank's experts of whatever transformers
writes into them. Transformers initialises a ``[E, ...]`` expert tensor with one call of
``normal_`` (or ``uniform_``) on the global generator; the stand-in makes that call one expert
at a time, each expert's draws made and those of other ranks' experts dropped, so the
generator moves exactly as it does for the whole tensor and every other tensor drawn after it
gets the same values (the same seed gives the single-process model's weights). Memory: the
replicated tensors, this rank's experts, and one expert's draws at a time.
"""

from __future__ import annotations

import threading

import torch

aten = torch.ops.aten

# A CPU normal_ of 16 or more elements fills blocks of 16 from the generator: drawn an
# expert at a time, it matches the whole tensor's draw where an expert's size is a multiple
_BLOCK = 16
_BUILDING = threading.Lock()      # the experts classes are patched while a model is built


def _an_expert_at_a_time(shape) -> bool:
    """Whether an expert tensor of ``shape`` is drawn an expert at a time (its experts'
    draws then match the whole tensor's), or whole."""
    per = torch.Size(shape[1:]).numel()
    return shape[0] > 0 and per >= _BLOCK and per % _BLOCK == 0


class _ExpertDraws(torch.Tensor):
    """An expert tensor of the whole ``[E, ...]`` shape, holding rows ``[lo, hi)`` alone.

    Only what transformers' initialisation does to an expert tensor is taken: ``normal_``
    and ``uniform_`` (drawn an expert at a time, the rows of ``[lo, hi)`` kept), ``zero_``
    and ``fill_``, and what ``nn.Parameter`` needs; anything else is refused, naming it."""

    @staticmethod
    def __new__(cls, shape, dtype, lo, hi, rows=None, drawn=None):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu")
        t.lo, t.hi = lo, hi
        t.rows = rows if rows is not None else torch.empty((hi - lo, *shape[1:]), dtype=dtype)
        t.drawn = drawn if drawn is not None else [0]     # the largest draw held at once
        return t

    def __repr__(self):
        return f"_ExpertDraws(shape={list(self.shape)}, rows [{self.lo}, {self.hi}))"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return _ExpertDraws(t.shape, t.dtype, t.lo, t.hi, t.rows, t.drawn)
        if func in (aten.normal_.default, aten.uniform_.default):
            t._draw(func, args[1:], kwargs)
            return t
        if func in (aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor):
            func(t.rows, *args[1:], **kwargs)
            return t
        raise ValueError(f"from_hf_config builds each rank's experts alone and takes "
                         f"transformers' initialisation of them by normal_, uniform_, zero_ "
                         f"or fill_; this model's code calls {func} on them. Build the whole "
                         f"model and call from_hf_model(model, group=...) instead")

    def _draw(self, func, args, kwargs) -> None:
        with torch.no_grad():
            if not _an_expert_at_a_time(self.shape):    # drawn whole: the same stream for sure
                whole = torch.empty(self.shape, dtype=self.dtype)
                func(whole, *args, **kwargs)
                self.rows.copy_(whole[self.lo:self.hi])
                self.drawn[0] = max(self.drawn[0], whole.nbytes)
                return
            chunk = torch.empty(self.shape[1:], dtype=self.dtype)
            self.drawn[0] = max(self.drawn[0], chunk.nbytes)
            for e in range(self.shape[0]):
                func(chunk, *args, **kwargs)
                if self.lo <= e < self.hi:
                    self.rows[e - self.lo].copy_(chunk)


def from_hf_config(config, *, group=None, init: bool = True, dtype=None, device=None,
                   **from_hf_model_kwargs):
    """``(params, loss_fn)`` of a transformers MoE model built with this rank's experts alone.

    Builds ``AutoModelForCausalLM.from_config(config)`` as transformers does, except that
    each sparse block keeps only the experts of this rank of ``group`` (``[r E/R,
    (r+1) E/R)``), then takes it as `from_hf_model` ``(model, group=group)`` does. Seeded the
    same way (``torch.manual_seed``), every rank's tensors equal the single-process model's:
    the replicated ones whole, the experts on its own shard.

    Args:
        config: a transformers config of a family `from_hf_model` takes.
        group: a process group or ``("dp", "ep")`` mesh to shard the experts over (its ``ep``
            dim); ``None``: one process, the whole model.
        init: initialise the weights as transformers does (``False``: leave them
            uninitialised, for `psf.load_checkpoint` to fill).
        dtype: the dtype transformers builds in (default the config's).
        device: where the model goes once built (default the CPU, where it is built).
        **from_hf_model_kwargs: ``loss_chunk``, ``fused_norms``, ``checkpoint_attention``,
            as `from_hf_model` takes them.

    Returns:
        ``(params, loss_fn)`` as `from_hf_model` returns them; ``loss_fn.model`` is the model,
            its expert Parameters holding this rank's shard.

    Raises:
        ValueError: as `from_hf_model` raises it, for experts that do not split over
            ``group``, or for a model whose code initialises its experts otherwise than by
            ``normal_``, ``uniform_``, ``zero_`` or ``fill_``.

    Example::

        torch.manual_seed(0)
        params, loss_fn = psf.from_hf_config(config, group=mesh, dtype=torch.bfloat16,
                                             device="cuda")
    """
    import copy

    import transformers

    from ._models import from_hf_model, sparse_blocks
    from ..parallel._mesh import check_experts_split, ep_position
    config = copy.deepcopy(config)               # transformers writes the dtype into it
    with torch.device("meta"):                   # which classes hold experts, how many
        probe = transformers.AutoModelForCausalLM.from_config(config)
    blocks = sparse_blocks(probe)
    experts = next(iter(blocks.values())).experts.gate_up_proj.shape[0]
    kinds = {type(b.experts) for b in blocks.values()}
    del probe, blocks
    rank, ranks = ep_position(group)
    check_experts_split(experts, ranks)
    per = experts // ranks
    lo, hi = rank * per, (rank + 1) * per
    kwargs = {} if dtype is None else {"dtype": dtype}
    with _BUILDING:
        originals = {k: k.__init__ for k in kinds}
        try:
            for k in kinds:
                k.__init__ = _standing_in(originals[k], lo, hi)
            if init:
                model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
            else:
                from transformers.initialization import no_init_weights
                with no_init_weights():
                    model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
        finally:
            for k in kinds:
                k.__init__ = originals[k]
    drawn = 0
    for block in sparse_blocks(model).values():
        for name, p in list(block.experts._parameters.items()):
            if isinstance(p, _ExpertDraws):
                drawn = max(drawn, p.drawn[0])
                block.experts._parameters[name] = torch.nn.Parameter(p.rows)
    if device is not None:
        model = model.to(device)
    model._psf_shard = (rank, ranks)             # what from_hf_model is told it holds
    params, loss_fn = from_hf_model(model, group=group, **from_hf_model_kwargs)
    held = {t.data_ptr(): t.nbytes for t in model.state_dict().values()}
    loss_fn.built_bytes = {"held": sum(held.values()), "drawn": drawn}
    return params, loss_fn


def _standing_in(original, lo, hi):
    """An experts class's ``__init__`` whose 3-D Parameters are `_ExpertDraws` stand-ins."""
    def __init__(self, *args, **kwargs):
        with torch.device("meta"):               # the whole tensors are never allocated
            original(self, *args, **kwargs)
        for name, p in list(self._parameters.items()):
            if p is not None and p.dim() == 3:
                self._parameters[name] = torch.nn.Parameter(
                    _ExpertDraws(p.shape, p.dtype, lo, hi), requires_grad=p.requires_grad)
    return __init__


def build_bytes(config, ranks: int = 1, dtype=None) -> dict:
    """Bytes one rank of ``ranks`` holds while `from_hf_config` builds ``config``, counted
    on a model made on the meta device (nothing allocated).

    Args:
        config: a transformers config of a family `from_hf_model` takes.
        ranks: the ``ep`` ranks the experts are split over.
        dtype: the dtype the model is built in (default the config's).

    Returns:
        ``{"replicated", "experts", "drawn", "peak", "whole"}``: bytes of the replicated
            tensors (parameters and buffers), of this rank's experts, of the largest draw
            held at once (one expert's tensor), their sum (the most the build holds), and the
            whole model's tensors (what building it whole holds).

    Raises:
        ValueError: ``ranks`` is not a positive integer dividing the experts.
    """
    import copy

    import transformers

    from ._models import sparse_blocks
    from ..parallel._mesh import check_experts_split
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, got {ranks!r}")
    config = copy.deepcopy(config)
    kwargs = {} if dtype is None else {"dtype": dtype}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    blocks = sparse_blocks(model)
    expert_ids = {id(p) for b in blocks.values() for p in b.experts.parameters()
                  if p.dim() == 3}
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    whole = sum(t.nbytes for t in tensors.values())
    expert = sum(tensors[i].nbytes for i in expert_ids if i in tensors)
    drawn = max(p[0].nbytes if _an_expert_at_a_time(p.shape) else p.nbytes
                for b in blocks.values() for p in b.experts.parameters() if p.dim() == 3)
    check_experts_split(next(iter(blocks.values())).experts.gate_up_proj.shape[0], ranks)
    out = {"replicated": whole - expert, "experts": expert // ranks, "drawn": drawn}
    out["peak"] = out["replicated"] + out["experts"] + out["drawn"]
    out["whole"] = whole
    return out
