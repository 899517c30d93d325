"""`stash_aware`: turn a loss into a pure ``(params, batch, state) -> (loss, state)`` step.

The user's loss calls `psf.moe` as plain math. The step opens a *frame* (`_frame`) around the
loss, and each `psf.moe` call inside becomes one layer of the step (``moe0``, ``moe1``, ... in
call order) with its own capacity, page tables and routing counts, as Haiku's
``transform_with_state`` threads state through modules. The loss never sees a page.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from . import _frame
from ._config import StashConfig
from ._experts import moe_stash_specs
from ._pools import init_stash_state
from ._state import StashState


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
        frame = _frame.Frame("record", cfg=self.cfg)
        with torch.no_grad(), _frame.opened(frame):
            self.loss_fn(params, batch)
        specs, counts = [], {}
        for info in frame.layers:
            if self.cfg.paged_stash:
                shape = {"w_gate_up": torch.empty(info.num_experts, info.hidden, 2 * info.ffn,
                                                  dtype=info.dtype, device="meta")}
                specs += moe_stash_specs(info.name, shape, tokens=info.tokens, top_k=info.top_k,
                                         cfg=self.cfg, observed_rows=info.observed_rows)
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
        frame = _frame.Frame("capacity", cfg=self.cfg, state=state.successor())
        with _frame.opened(frame):
            out = self.loss_fn(params, batch)
        if frame.calls != len(state.layers):
            raise ValueError(
                f"the loss called psf.moe {frame.calls} times but the state was built for "
                f"{len(state.layers)} calls; rebuild it with step.init(params, batch)")
        return _with_state(out, frame.state)

    def exact(self, params, batch):
        """``loss_fn(params, batch)`` with every `psf.moe` on the exact, dropless path."""
        with _frame.opened(_frame.Frame("exact")):
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
    for leaf in pytree.tree_leaves(params):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")
