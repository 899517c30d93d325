"""`stash_aware`: turn a loss into a pure ``(params, batch, state) -> (loss, state)`` step.

The user's loss calls `psf.moe` as plain math. The step opens a *frame* (`_frame`) around the
loss, and each `psf.moe` call inside becomes one layer of the step (``moe0``, ``moe1``, ... in
call order) with its own capacity, page tables and routing counts, as Haiku's
``transform_with_state`` threads state through modules. The loss never sees a page.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import torch
import torch.utils._pytree as pytree

from ..core import _frame
from ..core._config import StashConfig
from ..parallel._expert_parallel import agree_on_layers, prepare_transport, reserve_layers
from ..parallel._placement import agree
from ..stash._pools import init_stash_state, moe_stash_specs
from ..stash._state import StashState, StateMismatchError
from ..core._function import fast_apply


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

    Args:
        loss_fn: ``loss_fn(params, batch) -> loss | (loss, aux)``: ``loss`` a 0-d tensor,
            ``aux`` a tree of tensors; its MoE layers are `psf.moe` calls.
        cfg: the `StashConfig` of the step.

    Raises:
        ValueError: ``loss_fn`` is not callable, or ``cfg`` is not a `StashConfig`.
    """

    compiled = False        # `psf.compile` makes one that is

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
        Generators in ``batch`` are put back where they were, so the first step draws what this
        pass drew.

        Args:
            params: the parameters the steps will take (any pytree the loss reads).
            batch: a batch of the shape the steps will take (a state serves one shape).

        Returns:
            A live `StashState` on the device of the MoE calls (the params' device otherwise), with
                a `LayerInfo` per `psf.moe` call.

        Raises:
            ValueError: the loss calls `psf.moe` nowhere, ``cfg.layer_factors`` names a layer the
                loss does not call, the loss's output is not a 0-d loss (or ``(loss, aux)``), or
                the batch and the params sit on different devices (naming both).
            TypeError: the loss's ``aux`` holds something other than tensors.
        """
        frame = _frame.Frame("record", cfg=self.cfg)
        generators = generator_states(batch)
        with torch.no_grad(), _frame.opened(frame), _devices_named(params, batch):
            out = self.loss_fn(params, batch)
        restore_generators(generators)
        _check_output(out)                   # a loss the steps would refuse, refused here
        if not frame.layers:
            raise ValueError(
                "the loss calls psf.moe nowhere: a stash_aware step bounds and stashes only "
                "psf.moe calls, so nothing here would be capacity-bounded or stashed. Compute "
                "the MoE layers with psf.moe (psf.from_hf_model does it for a transformers "
                "model), or differentiate a loss without them directly (psf.value_and_grad, "
                "torch.func.grad)")
        _check_layer_factors(frame, self.cfg)
        frame.layers = _agree_per_group(frame, self.cfg)
        specs, counts = [], {}
        for info in frame.layers:
            if self.cfg.paged_stash:
                shape = {"w_gate_up": torch.empty(info.num_experts, info.hidden, 2 * info.ffn,
                                                  dtype=info.dtype, device="meta")}
                specs += moe_stash_specs(info.name, shape, tokens=info.tokens, top_k=info.top_k,
                                         cfg=self.cfg, observed_rows=info.observed_rows,
                                         group_size=info.group_size)
            counts[f"{info.name}/expert_load"] = info.num_experts
            counts[f"{info.name}/rows"] = 1
        device = frame.device if frame.device is not None else _first_device(params)
        return init_stash_state(specs, self.cfg, device=device, counts=counts,
                                layers=tuple(frame.layers))

    def __call__(self, params, batch, state: StashState):
        """Run the step: the loss with its `psf.moe` calls on the capacity path.

        The state threads through the calls; without a ``capacity_factor`` every call runs
        the exact path.

        Args:
            params: the parameters (differentiate through them, e.g. with
                ``torch.func.grad_and_value(step, has_aux=True)``).
            batch: a batch of the shape ``state`` was built for.
            state: the live `StashState` from ``step.init`` or the previous step; consumed.

        Returns:
            ``(loss, new_state)``, or ``(loss, (aux, new_state))`` when ``loss_fn`` returns
                ``(loss, aux)``.

        Raises:
            ConsumedStateError: ``state`` was consumed by an earlier call.
            StateMismatchError: the loss calls `psf.moe` with other shapes, or another number of
                times, than ``state`` was built for.
            ValueError: the loss's output is not a 0-d loss (or ``(loss, aux)``), or under
                ``torch.func.grad`` without ``has_aux=True``.
            TypeError: ``state`` is not a `StashState`, or the loss's ``aux`` holds something
                other than tensors.
        """
        if torch._C._functorch.maybe_current_level() is not None:
            _check_has_aux(self)
        return self._step(params, batch, state, fresh=False)

    def attempt(self, params, batch, state: StashState):
        """The step with the state's flags and statistics cleared first.

        What comes out counts this call alone (what `run_step` differentiates).

        Args:
            params: the parameters.
            batch: a batch of the shape ``state`` was built for.
            state: the live `StashState`; consumed.

        Returns:
            As the step's call: ``(loss, new_state)`` or ``(loss, (aux, new_state))``.

        Raises:
            ConsumedStateError: ``state`` was consumed by an earlier call.
            StateMismatchError: the loss's `psf.moe` calls do not match ``state``.
        """
        return self._step(params, batch, state, fresh=True)

    def _step(self, params, batch, state, fresh):
        if torch._C._functorch.maybe_current_level() is not None:
            _refuse_compiled_transform()
        check_state(state)
        _check_scope(self.cfg, state)
        if not self.cfg.uses_capacity:
            out = self.exact(params, batch)
            state.consume("a stash_aware step")
            return _with_state(out, state.successor())
        state.consume("a stash_aware step")
        start = state.cleared() if fresh else state.successor()
        frame = _frame.Frame("capacity", cfg=self.cfg, state=start, compiled=self.compiled)
        try:
            out = self._run(frame, params, batch)
            if frame.calls != len(state.layers):
                raise StateMismatchError(
                    f"the loss called psf.moe {frame.calls} times but the state was built for "
                    f"{len(state.layers)} calls; rebuild it with step.init(params, batch)")
        except BaseException as err:
            _after_failure(state, frame, err)
            raise
        new_state = frame.state.with_groups(frame.groups)
        if len(out) == 2:
            return out[0], (out[1], new_state)
        return out[0], new_state

    def exact(self, params, batch):
        """``loss_fn(params, batch)`` with every `psf.moe` on the exact, dropless path.

        Args:
            params: the parameters.
            batch: the batch (no state: the exact path stashes nothing).

        Returns:
            ``loss``, or ``(loss, aux)`` when ``loss_fn`` returns a pair.
        """
        out = self._run(_frame.Frame("exact"), params, batch)
        return out if len(out) == 2 else out[0]

    def _run(self, frame, params, batch) -> tuple:
        """``(loss,)`` or ``(loss, aux)`` of the loss run in ``frame``, checked; the outputs of
        expert-parallel layers are tied to the loss (see `_Anchor`)."""
        with _frame.opened(frame), _devices_named(params, batch):
            out = self.loss_fn(params, batch)
        out = _check_output(out)
        if frame.anchors:
            out = (_Anchor.apply(out[0], *frame.anchors), *out[1:])
        return out


def check_state(state) -> None:
    """A step's third argument must be a live `StashState`."""
    if not isinstance(state, StashState):
        raise TypeError(f"the third argument must be the StashState from step.init (or the one "
                        f"the previous step returned), got {type(state).__name__}")
    state.check_alive()


def _refuse_compiled_transform() -> None:
    """``torch.compile`` over ``torch.func.grad`` (or ``vjp``, ``jacrev``) of a step: PyTorch's
    compiler runs the step's frames compiled under the transform, where psf.moe's backward is
    not run (it fails inside torch, or silently takes a default derivative). Seen from here as
    a functorch level open while the compiler's frame hook is set."""
    if _frame.under_compile_hook():
        raise NotImplementedError(COMPILE_OVER_GRAD)


COMPILE_OVER_GRAD = (
    "torch.func.grad, vjp or jacrev of a psf step under torch.compile (torch.compile over "
    "torch.func.grad, or torch.func.grad over psf.compile) is not supported: PyTorch's "
    "compiler does not run psf.moe's own backward under those transforms (it fails, or "
    "silently takes a default derivative). Compile the step with psf.compile(step) and "
    "differentiate it with psf.run_step, psf.value_and_grad(step.attempt) or loss.backward(); "
    "or keep torch.func.grad and leave the step uncompiled.")


def _check_has_aux(step) -> None:
    """Under ``torch.func.grad(step)`` (or ``grad_and_value``) without ``has_aux=True``,
    functorch would refuse the step's ``(loss, state)`` output with a message about tensors:
    say what the step returns and the spelling that takes it. Read from functorch's own
    frame (its ``func`` and ``has_aux`` arguments); nothing is said where that frame is not
    found, or differentiates another function (one that calls the step)."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return
        code = frame.f_code
        if code.co_name == "grad_and_value_impl" and code.co_filename.endswith(
                "eager_transforms.py"):
            local = frame.f_locals
            if local.get("func") is step and local.get("has_aux") is False:
                raise ValueError(
                    "a stash_aware step returns (loss, state), or (loss, (aux, state)) when "
                    "the loss returns an aux: differentiate it with has_aux=True, e.g. "
                    "grads, state = torch.func.grad(step, has_aux=True)(params, batch, state)"
                    ", or step with psf.run_step, which reruns what went over budget")
            return
        frame = frame.f_back


# torch's words for tensors on two devices in one op (CUDA and CPU, the meta device)
_DEVICE_MISMATCH = ("Expected all tensors to be on the same device",
                    "found at least two devices", "is not on the expected device")


@contextlib.contextmanager
def _devices_named(params, batch):
    """A loss that fails because the batch and the params sit on different devices: the
    error names the batch entry and both devices (torch's own names neither). Checked only
    after such a failure, since a batch may hold host tensors on purpose."""
    try:
        yield
    except RuntimeError as err:
        if not any(text in str(err) for text in _DEVICE_MISMATCH):
            raise
        where = _first_device(params)
        for path, leaf in pytree.tree_flatten_with_path(batch)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.device != where:
                raise ValueError(
                    f"batch{pytree.keystr(path)} is on {leaf.device} and the params on "
                    f"{where}: move the batch to the params' device (batch = "
                    f"{{k: v.to({str(where)!r}) for k, v in batch.items()}}) ({err})") from err
        raise


def _check_scope(cfg: StashConfig, state: StashState) -> None:
    """The state's pages must live where the step's config says (a state built by another
    step's ``init`` would silently page into the other scope)."""
    if not (cfg.paged_stash and state.specs):
        return
    scope = "layer" if state.layer_pools else "state"
    if scope != cfg.pool_scope:
        raise ValueError(
            f"this step's config has pool_scope={cfg.pool_scope!r} but the state was built "
            f"with pool_scope={scope!r}: build the state with this step's "
            f"step.init(params, batch) (or use the config the state was built with)")
    fp8 = {spec.dtype == torch.uint8 for spec in state.specs if spec.name.endswith("/act_in")}
    if fp8 and fp8 != {cfg.stash_precision == "fp8"}:
        built = "fp8" if True in fp8 else "same"
        raise ValueError(
            f"this step's config has stash_precision={cfg.stash_precision!r} but the state was "
            f"built with stash_precision={built!r}: build the state with this step's "
            f"step.init(params, batch)")


def generator_states(batch) -> list:
    """``[(generator, its state)]`` for every ``torch.Generator`` in ``batch``."""
    return [(g, g.get_state()) for g in pytree.tree_leaves(batch)
            if isinstance(g, torch.Generator)]


def restore_generators(states) -> None:
    """Put generators back where `generator_states` found them (a rerun then draws the same
    numbers as the attempt it replaces)."""
    for generator, state in states:
        generator.set_state(state)


def _after_failure(state: StashState, frame, err: BaseException) -> None:
    """A step that raised: if it stashed nothing, its state is untouched and stays usable;
    otherwise the pools hold pages nobody will pop, and the state says so when used again."""
    started = frame.state.consumed or any(r not in state.pending for r in frame.state.pending)
    if started:
        state.mark_failed(f"a stash_aware step that failed halfway ({type(err).__name__}: "
                          f"{err}); its pools may hold pages no backward will give back")
    else:
        state.revive()


@fast_apply
class _Anchor(torch.autograd.Function):
    """``loss`` unchanged, with the outputs of the step's expert-parallel layers as inputs, so
    that backward reaches every such layer on every rank (its exchanges are collectives: a
    layer whose output missed one rank's loss would leave the other ranks waiting)."""

    @staticmethod
    def forward(loss, *outputs):
        return loss.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.metas = [(o.shape, o.dtype, o.device) for o in inputs[1:]]

    @staticmethod
    def backward(ctx, grad):
        return (grad, *[torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.metas])


def _check_output(out) -> tuple:
    """``(loss,)`` or ``(loss, aux)``; aux must hold tensors only (torch.func refuses others)."""
    if isinstance(out, tuple):
        if len(out) != 2:
            raise ValueError(f"loss_fn must return a loss or a (loss, aux) pair, got a tuple of "
                             f"{len(out)}")
        for path, leaf in pytree.tree_flatten_with_path(out[1])[0]:
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"aux{pytree.keystr(path)} is a {type(leaf).__name__}: an aux output must "
                    f"hold tensors only (torch.func.grad refuses anything else); wrap numbers "
                    f"with torch.tensor(...) or return them outside the step")
    else:
        out = (out,)
    if not isinstance(out[0], torch.Tensor) or out[0].ndim != 0:
        hint = " (a 1-element tensor: return loss.squeeze())" \
            if isinstance(out[0], torch.Tensor) and out[0].numel() == 1 else ""
        raise ValueError(f"loss_fn must return a 0-d scalar tensor loss, got "
                         f"{getattr(out[0], 'shape', type(out[0]).__name__)}{hint}")
    return out


def stash_aware(loss_fn, cfg: StashConfig) -> StashAwareStep:
    """Make ``loss_fn(params, batch) -> loss | (loss, aux)`` a pure stash-aware step.

    See `StashAwareStep` for the contract.

    Args:
        loss_fn: ``loss_fn(params, batch)``, returning a 0-d loss or ``(loss, aux)``; its MoE
            layers are `psf.moe` calls.
        cfg: the `StashConfig` of the step.

    Returns:
        A `StashAwareStep`.

    Raises:
        ValueError: ``loss_fn`` is not callable, or ``cfg`` is not a `StashConfig`.

    Example::

        step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=1.25,
                                                        paged_stash=True))
        state = step.init(params, batch)
        grads, (loss, state) = torch.func.grad_and_value(step, has_aux=True)(
            params, batch, state)
    """
    return StashAwareStep(loss_fn, cfg)


def _with_state(out, state):
    if isinstance(out, tuple):
        loss, aux = out
        return loss, (aux, state)
    return out, state


def _first_device(params):
    for leaf in pytree.tree_leaves(params):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def _check_layer_factors(frame, cfg) -> None:
    """`ValueError` for a ``layer_factors`` name the loss does not call, on every rank of
    each expert-parallel group when any of them has one (a rank raising alone would leave the
    others waiting in the next collective): every group's ranks meet, in the order of their
    ranks, whatever an earlier group said."""
    unknown = sorted(set(dict(cfg.layer_factors)) - {i.name for i in frame.layers})
    error = ValueError(f"layer_factors names {unknown}, but the loss calls psf.moe "
                       f"{len(frame.layers)} times, as {[i.name for i in frame.layers]} (in "
                       f"call order)") if unknown else None
    groups = {tuple(torch.distributed.get_process_group_ranks(g)): g
              for _, g in frame.recorded_groups}
    first = error
    for ranks in sorted(groups):
        try:
            agree(groups[ranks], error, "step.init's layer_factors")
        except ValueError as err:
            first = first or err
    if first is not None:
        raise first


def _agree_per_group(frame, cfg) -> list:
    """The recorded layers, each expert-parallel one with its group's transport, after the
    ranks of each group agreed on that group's layers (the fields that size or type an
    exchange, and the transport). Groups over the same ranks are one; the groups are visited in
    the order of their ranks, the same order on every rank, so ranks in several groups meet
    their peers' collectives in turn."""
    by_ranks = {}
    for index, group in frame.recorded_groups:
        ranks = tuple(torch.distributed.get_process_group_ranks(group))
        by_ranks.setdefault(ranks, (group, []))[1].append(index)
    layers = list(frame.layers)
    for ranks in sorted(by_ranks):
        group, indices = by_ranks[ranks]
        spread = [layers[i] for i in indices if layers[i].group_size > 1]
        transport = prepare_transport(group, cfg)
        agree_on_layers(group, spread, cfg.paged_stash)
        if transport == "nvshmem":
            reserve_layers(group, spread)
        for i in indices:
            if layers[i].group_size > 1:
                layers[i] = dataclasses.replace(layers[i], transport=transport)
    return layers
