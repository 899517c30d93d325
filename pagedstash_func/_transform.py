"""`stash_aware`: turn a loss into a pure ``(params, batch, state) -> (loss, state)`` step.

The user's loss calls `psf.moe` as plain math. The step opens a *frame* around the loss, and
each `psf.moe` call inside becomes one layer of the step (``moe0``, ``moe1``, ... in call
order) with its own capacity, page tables and routing counts, as Haiku's
``transform_with_state`` threads state through modules. The loss never sees a page.
"""

from __future__ import annotations

import dataclasses

import torch

from . import _frame
from ._config import StashConfig
from ._moe import _prepare, capacity_rows, moe_capacity, moe_exact, moe_stash_specs
from ._routing import canonical_ids
from ._state import StashState, init_stash_state


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """Static facts of one `psf.moe` call of a step, found by `StashAwareStep.init`."""

    name: str
    tokens: int
    top_k: int
    num_experts: int
    hidden: int
    ffn: int
    dtype: torch.dtype
    expert_ranks: int
    capacity: int            # rows of the capacity buffer (0 without a capacity factor)
    balanced_rows: int       # T * k
    observed_rows: int       # non-padding pairs seen when the state was built


class _RecordingFrame:
    """Runs every call on the exact path and writes down what it saw."""

    def __init__(self, cfg: StashConfig):
        self.cfg = cfg
        self.layers: list[LayerInfo] = []
        self.device = None

    def moe(self, params, x, *, top_k, norm_topk_prob, routing):
        x2d, ids, _, num_experts = _prepare(params, x, top_k, norm_topk_prob, routing)
        ids, _ = canonical_ids(ids, num_experts)
        _, hidden, two_ffn = params["w_gate_up"].shape
        tokens = x2d.shape[0]
        capacity = capacity_rows(tokens, top_k, self.cfg)[1] if self.cfg.uses_capacity else 0
        self.layers.append(LayerInfo(
            name=f"moe{len(self.layers)}", tokens=tokens, top_k=top_k, num_experts=num_experts,
            hidden=hidden, ffn=two_ffn // 2, dtype=params["w_gate_up"].dtype,
            expert_ranks=self.cfg.expert_ranks, capacity=capacity,
            balanced_rows=tokens * top_k, observed_rows=int((ids < num_experts).sum())))
        self.device = x.device
        return moe_exact(params, x, top_k=top_k, norm_topk_prob=norm_topk_prob,
                         routing=routing)


class _CapacityFrame:
    """Routes each call through `moe_capacity`, threading the state."""

    def __init__(self, cfg: StashConfig, state: StashState):
        self.cfg = cfg
        self.state = state
        self.calls = 0

    def moe(self, params, x, *, top_k, norm_topk_prob, routing):
        layers = self.state.layers
        if self.calls >= len(layers):
            raise ValueError(
                f"the loss called psf.moe more often ({self.calls + 1}) than when the state was "
                f"built ({len(layers)} calls); rebuild it with step.init(params, batch)")
        info = layers[self.calls]
        tokens = x.numel() // x.shape[-1]
        if (tokens, top_k) != (info.tokens, info.top_k):
            raise ValueError(
                f"psf.moe call {self.calls} ({info.name}) sees {tokens} tokens with top_k="
                f"{top_k}, but the state was built for {info.tokens} tokens with top_k="
                f"{info.top_k}; rebuild it with step.init for this batch shape")
        self.calls += 1
        y, self.state = moe_capacity(params, x, self.state, layer=info.name, top_k=top_k,
                                     cfg=self.cfg, norm_topk_prob=norm_topk_prob,
                                     routing=routing)
        return y


class _ExactFrame:
    """Every call on the exact, dropless path (the runner's rerun)."""

    def moe(self, params, x, *, top_k, norm_topk_prob, routing):
        return moe_exact(params, x, top_k=top_k, norm_topk_prob=norm_topk_prob,
                         routing=routing)


class StashAwareStep:
    """A stash-aware training step: ``(params, batch, state) -> (loss, new_state)``.

    Contract::

        step = psf.stash_aware(loss_fn, cfg)
        state = step.init(params, batch)
        loss, state = step(params, batch, state)                  # loss_fn returns a loss
        loss, (aux, state) = step(params, batch, state)           # loss_fn returns (loss, aux)
        grads, (loss, state) = ...  # with torch.func.grad_and_value(step, has_aux=True)

    The step is pure: the state passed in is consumed and a new one comes out; passing a
    consumed state again raises `ConsumedStateError`. ``loss_fn(params, batch)`` must draw any
    randomness from seeds or generators inside ``batch``.
    """

    def __init__(self, loss_fn, cfg: StashConfig):
        if not callable(loss_fn):
            raise ValueError(f"stash_aware needs a callable loss_fn(params, batch), got "
                             f"{type(loss_fn).__name__}")
        if not isinstance(cfg, StashConfig):
            raise ValueError(f"cfg must be a psf.StashConfig, got {type(cfg).__name__}")
        self.loss_fn = loss_fn
        self.cfg = cfg

    def init(self, params, batch) -> StashState:
        """Build the first state: one exact pass (no grad) finds the `psf.moe` calls.

        Pools are sized from the calls' balanced references (``T * k`` rows each); a negative
        ``cuda_factor``/``host_factor`` uses the non-padding rows this pass observed instead.
        """
        frame = _RecordingFrame(self.cfg)
        with torch.no_grad(), _frame.opened(frame):
            self.loss_fn(params, batch)
        specs, counts = [], {}
        for info in frame.layers:
            if self.cfg.paged_stash:
                layer_params = {"w_gate_up": torch.empty(info.num_experts, info.hidden,
                                                         2 * info.ffn, dtype=info.dtype,
                                                         device="meta")}
                for spec in moe_stash_specs(info.name, layer_params, tokens=info.tokens,
                                            top_k=info.top_k, cfg=self.cfg):
                    specs.append(dataclasses.replace(spec, observed_rows=info.observed_rows))
            counts[f"{info.name}/expert_load"] = info.num_experts
            counts[f"{info.name}/rows"] = 1
        device = frame.device if frame.device is not None else _first_device(params)
        return init_stash_state(specs, self.cfg, device=device, counts=counts,
                                layers=tuple(frame.layers))

    def __call__(self, params, batch, state: StashState):
        if not isinstance(state, StashState):
            raise ValueError(f"the third argument must be the StashState from step.init (or "
                             f"the one the previous step returned), got {type(state).__name__}")
        state.check_alive()
        if not self.cfg.uses_capacity:
            out = self.exact(params, batch)
            state.consume("a stash_aware step")
            return _with_state(out, state.successor())
        state.consume("a stash_aware step")
        frame = _CapacityFrame(self.cfg, state.successor())
        with _frame.opened(frame):
            out = self.loss_fn(params, batch)
        if frame.calls != len(state.layers):
            raise ValueError(
                f"the loss called psf.moe {frame.calls} times but the state was built for "
                f"{len(state.layers)} calls; rebuild it with step.init(params, batch)")
        return _with_state(out, frame.state)

    def exact(self, params, batch):
        """``loss_fn(params, batch)`` with every `psf.moe` on the exact, dropless path."""
        with _frame.opened(_ExactFrame()):
            return self.loss_fn(params, batch)


def stash_aware(loss_fn, cfg: StashConfig) -> StashAwareStep:
    """Make ``loss_fn(params, batch) -> loss | (loss, aux)`` a pure stash-aware step.

    See `StashAwareStep` for the contract. Example::

        step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=1.25,
                                                        paged_stash=True))
        state = step.init(params, batch)
        grads, (loss, state) = torch.func.grad_and_value(step, has_aux=True)(
            params, batch, state)
    """
    return StashAwareStep(loss_fn, cfg)


def _with_state(out, state):
    if isinstance(out, tuple):
        if len(out) != 2:
            raise ValueError("loss_fn must return a loss or a (loss, aux) pair")
        loss, aux = out
        return loss, (aux, state)
    return out, state


def _first_device(params):
    for leaf in torch.utils._pytree.tree_leaves(params):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")
