"""Whether a model still is what `from_hf_model` took its params from: its modules,
parameters, their memory, shapes and dtypes, and each sparse block's routing settings,
recorded once and compared at every call of the loss; a change is described in words.
"""

from __future__ import annotations

import operator

__all__ = ["ModelWatch"]


class ModelWatch:
    """Tells whether a model still is what `from_hf_model` took ``params`` from (see
    `_fingerprint`). The check runs at every call of the loss, so it walks what it recorded
    rather than the model's names: each module's children and parameters are the same
    objects, each parameter's data at the same address with the same shape and dtype, each
    sparse block's bias and routing settings the same (about 1.5 ms for a 48-layer model on
    a CPU core: a few microseconds a module); only a change is described, from a full
    fingerprint."""

    def __init__(self, model, blocks):
        self.model, self.blocks = model, blocks
        self.built = _fingerprint(model, blocks)
        self.routing = self.built[1]
        self._record()

    def _record(self) -> None:
        """What `_same` compares against: the objects the model holds now."""
        model, blocks = self.model, self.blocks
        self.slots = [(d, tuple(d.values())) for m in model.modules()
                      for d in (m._modules, m._parameters)]
        self.slots += [(b.gate._buffers, tuple(b.gate._buffers.values()))
                       for b, _ in blocks.values()]
        self.tensors = [p for _, p in model.named_parameters(remove_duplicate=False)]
        self.tensors += [b for b in (getattr(block.gate, "e_score_correction_bias", None)
                                     for block, _ in blocks.values()) if b is not None]
        self.facts = [_facts(t) for t in self.tensors]

    def change(self) -> str | None:
        """``None`` while the model computes what ``params`` give; else its first change, in
        words. Objects replaced without a change of what the loss reads (a Parameter re-made
        over the same memory, as ``load_state_dict(to_hf_state_dict(params, model),
        assign=True)`` does; a module without parameters) are accepted, and recorded anew."""
        if self._same():
            return None
        said = _first_change(self.built, _fingerprint(self.model, self.blocks))
        if said is not None:
            return said
        for prefix, (block, _) in self.blocks.items():
            try:
                there = self.model.get_submodule(prefix)
            except AttributeError:
                there = None
            if there is not block:
                return f"{prefix} is another module than the sparse block psf computes"
        self._record()
        return None

    def _same(self) -> bool:
        for slot, held in self.slots:
            if not _held(slot, held):
                return False
        if [_facts(t) for t in self.tensors] != self.facts:
            return False
        now = {prefix: _routing_of(block) for prefix, (block, _) in self.blocks.items()}
        return now == self.routing


def _held(slot: dict, held: tuple) -> bool:
    """Whether ``slot`` (a module's ``_modules``, ``_parameters`` or ``_buffers``) still holds
    the objects ``held``, by identity (``==`` on tensors would compare values)."""
    return len(slot) == len(held) and all(map(operator.is_, slot.values(), held))


def _routing_of(block) -> tuple:
    """A sparse block's routing settings, as its forward (or its gate's) reads them: plain
    attributes set in ``__init__``, read from the instance's ``__dict__`` (a missing name
    through ``nn.Module.__getattr__`` costs an exception)."""
    return tuple((owner, a, vars(m).get(a))
                 for owner, m in (("", block), (".gate", block.gate)) for a in ROUTING_SETTINGS)


def _fingerprint(model, blocks) -> tuple:
    """``(tensors, routing)``: every parameter of ``model`` by name (tied names each) with
    where its data lives, its dtype and shape, each sparse block's score-correction bias
    likewise, and each block's routing settings as its forward reads them. Two fingerprints
    differ when the model would compute other numbers than ``params`` give, except through a
    value changed in place (which ``params`` shares)."""
    tensors = {name: _facts(p) for name, p in model.named_parameters(remove_duplicate=False)}
    routing = {}
    for prefix, (block, _) in blocks.items():
        bias = getattr(block.gate, "e_score_correction_bias", None)
        tensors[f"{prefix}.gate.e_score_correction_bias"] = _facts(bias)
        routing[prefix] = _routing_of(block)
    return tensors, routing


# What a sparse block's forward (or its gate's) reads to route, across the families.
ROUTING_SETTINGS = ("top_k", "norm_topk_prob", "routed_scaling_factor", "num_group", "n_group",
                    "topk_group", "num_experts", "n_routed_experts")


def _facts(t) -> tuple | None:
    """Where and how a tensor's data lies (``None`` for no tensor): its address, dtype,
    shape, device, strides and offset, so a ``.data`` assigned over the same memory with
    another view (a transpose, an offset) changes it too."""
    return None if t is None else (t.data_ptr(), t.dtype, tuple(t.shape), t.device,
                                   t.stride(), t.storage_offset())


def _first_change(built: tuple, now: tuple) -> str | None:
    """The first difference between two `_fingerprint` s, in words (``None``: none)."""
    (was, routing_was), (tensors, routing) = built, now
    gone = [n for n in was if n not in tensors]
    new = [n for n in tensors if n not in was]
    if gone or new:
        return f"parameters {new[:3]} appeared and {gone[:3]} went" if gone and new else \
            f"new parameters {new[:3]}" if new else f"parameters {gone[:3]} are gone"
    for name, facts in tensors.items():
        old = was[name]
        if facts != old:
            if old is None or facts is None:
                return f"{name} was {'added' if old is None else 'removed'}"
            what = "shape" if old[2] != facts[2] else "dtype" if old[1] != facts[1] else \
                "device" if old[3] != facts[3] else "memory (a new tensor or .data assigned)" \
                if old[0] != facts[0] else "layout over the same memory (.data assigned a view)"
            seen = {"shape": (list(old[2]), list(facts[2])), "dtype": (old[1], facts[1]),
                    "device": (old[3], facts[3])}.get(what)
            return f"{name} has another {what}" + (f" ({seen[0]} -> {seen[1]})" if seen else "")
    for prefix, settings in routing.items():
        for (owner, attr, value), (_, _, before) in zip(settings, routing_was[prefix]):
            if value != before:
                return f"{prefix}{owner}.{attr} is {value!r}, was {before!r}"
    return None
