"""`psf.compile`: a stash-aware step whose capacity attempt runs as one compiled graph.

The capacity path has what a whole-graph compiler needs (static shapes, no host read, state in
and out), so ``torch.compile(..., fullgraph=True)`` takes the attempt whole: routing,
dispatch, experts, the stash's copies and pops (custom ops that declare the pools they
mutate), combine, statistics and flags, forward and backward. What cannot be a graph is the
host-side status of each layer's pages (a `StashRecord`): whether its backward has run, so
that a second backward, or one after `psf.reclaim`, is refused instead of reading pages that
went back. Eager, each layer's backward checks its own record. Compiled, `CompiledStep` checks
them all from outside the graph, in a hook that runs before the compiled backward and one that
runs after it. That is why the spelling is ``psf.compile(step)`` and not ``torch.compile(step)``
(which a stashing step refuses, naming this one).

The exact path (`StashAwareStep.exact`, the runner's rerun) stays eager: its buffers are sized
by host reads of the routed counts, which a static graph cannot take.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import types

import torch

from ..experts._experts import SECOND_ORDER
from ._transform import COMPILE_OVER_GRAD, StashAwareStep, check_state


class CompiledStep(StashAwareStep):
    """A `StashAwareStep` whose capacity attempt is compiled by ``torch.compile``.

    Made by `compile` (which takes the same arguments). It is a `StashAwareStep`: ``init``,
    ``exact`` (eager), `run_step`, `psf.value_and_grad` and ``.backward()`` take it as they
    take the step it wraps, and give the same numbers.

    Args:
        step: the `StashAwareStep` it compiles.
        compile_kwargs: what ``torch.compile`` is given (``fullgraph=True`` unless set).

    Raises:
        TypeError: ``step`` is not a `StashAwareStep`, or is compiled already.
        ValueError: ``step`` stashes into a pool shared by its layers, or ``compile_kwargs``
            asks for dynamic shapes or (stashing) the ``"eager"`` backend.
    """

    compiled = True

    def __init__(self, step: StashAwareStep, compile_kwargs: dict):
        _check_compilable(step, compile_kwargs)
        super().__init__(step.loss_fn, step.cfg)
        self.step = step
        self.compile_kwargs = {"fullgraph": True, "dynamic": False, **compile_kwargs}
        self._body = functools.partial(_own_code(), self)     # what is traced
        self._graph = torch.compile(self._body, **self.compile_kwargs)

    def _step(self, params, batch, state, fresh):
        if torch._C._functorch.maybe_current_level() is not None:
            raise NotImplementedError(COMPILE_OVER_GRAD)
        check_state(state)          # refused here, in plain Python, before anything traces
        _refuse_generators(batch)
        if getattr(self.loss_fn, "checkpoint_attention", False):
            raise ValueError(
                "a from_hf_model loss with checkpoint_attention=True does not compile: the "
                "recomputed attention swaps the norms' forwards inside the checkpoint, which "
                "the compiler refuses. Compile with checkpoint_attention=False (the compiled "
                "graph frees what it can itself), or run this step uncompiled")
        state.settle()
        hold = getattr(self.loss_fn, "held", None)     # a from_hf_model loss: its host side
        try:
            with hold() if hold is not None else contextlib.nullcontext():
                out = self._graph(params, batch, state, fresh)
        except torch._dynamo.exc.TorchDynamoException as err:
            self._raise_psfs_own(params, batch, state, fresh, err)
            raise
        rest = out[1]
        new_state = rest[1] if isinstance(rest, tuple) else rest
        records = [r for r in new_state.pending if r.compiled and r.status == "held"]
        _Claims(records).attach(out, self.compile_kwargs.get("backend", "inductor"))
        return out

    def _raise_psfs_own(self, params, batch, state, fresh, err):
        """A step refused while it was traced reaches the caller as the compiler's exception
        (psf's message deep inside it, its type lost): run the same step eagerly, without
        gradients (nothing is stashed), and raise psf's own error from it if it raises one. The state itself is untouched: a trace that fails applies nothing;
        the probe is a successor of it (the same buffers, which a step without gradients
        does not write, and the same stashes waiting for their backward)."""
        probe = state.successor()
        try:
            with torch.no_grad():
                StashAwareStep._step(self.step, params, batch, probe, fresh)
        except Exception as own:
            raise own from err


class _Claims:
    """The host-side page checks of one compiled attempt's layers, run around its compiled
    backward (eager, each layer's backward runs them itself: `MoEExperts.backward`).

    Before the first compiled backward node runs, every record is claimed: refused if its
    pages went back already (a second backward, a backward after `psf.reclaim`, or after one
    that failed), then marked ``"failed"`` until the backward completes (so that a backward
    that raises halfway leaves records that `psf.reclaim` gives back and a retry refuses).
    Once every compiled node has run, the records are ``"popped"`` (the pools are the
    compiled graph's, freed by it). A node that runs again is a second backward, refused; so
    is a backward with ``create_graph=True`` (a second derivative to come), with or without
    the stash. Only records of layers traced into the graph are claimed here (with
    ``fullgraph=False`` a layer left to eager claims its own)."""

    def __init__(self, records):
        self.records, self.ran, self.nodes = records, set(), []

    def attach(self, out, backend) -> None:
        roots = [t.grad_fn for t in torch.utils._pytree.tree_leaves(out)
                 if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        self.nodes = _compiled_nodes(roots)
        if self.records and roots and not self.nodes:
            for record in self.records:
                record.status = "released"          # no backward may read them
            raise RuntimeError(
                f"the compiled step's backward is not one psf can guard: the backend "
                f"{backend!r} does not go through AOTAutograd, so nothing tells psf when the "
                f"stashed pages are read. Use a backend that does (the default 'inductor', "
                f"or 'aot_eager'), or compile without paged_stash.")
        for i, node in enumerate(self.nodes):
            node.register_prehook(lambda grads, i=i: self._before(i))
            node.register_hook(lambda grads_in, grads_out, i=i: self._after(i))

    def _before(self, i):
        if torch.is_grad_enabled():     # create_graph=True: the compiled backward is not
            raise RuntimeError(SECOND_ORDER.format(     # differentiable (nor is eager's)
                what="a second derivative (create_graph=True through a compiled step)"))
        if not self.ran or i in self.ran:           # a backward starts, or runs again
            self.ran = set()
            for record in self.records:
                record.claim()
                record.status = "failed"            # until every node has run
        self.ran.add(i)

    def _after(self, i):
        if len(self.ran) == len(self.nodes) and i in self.ran:
            for record in self.records:
                record.status = "popped"


# The name AOTAutograd gives the autograd node of a compiled graph (torch 2.11 and 2.13):
# "CompiledFunctionBackward"
COMPILED_NODE = "CompiledFunction"


def _compiled_nodes(roots) -> list:
    """The backward nodes of compiled graphs reachable from ``roots``: the graph is walked
    from the outputs until it meets them (what lies past them, the step's inputs, is not)."""
    seen, found, frontier = set(), [], list(roots)
    while frontier:
        node = frontier.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name().startswith(COMPILED_NODE):
            found.append(node)
        else:
            frontier += [n for n, _ in node.next_functions]
    return found


def compile(step: StashAwareStep, **compile_kwargs) -> CompiledStep:
    """A step whose capacity attempt runs compiled by ``torch.compile``, whole.

    The attempt (routing, dispatch, experts, the stash's copies and pops, combine, statistics,
    flags) becomes one graph with ``fullgraph=True`` and its backward one backward graph; the
    exact path (the rerun) stays eager. The first call compiles (seconds to minutes); a batch
    of another shape needs its own state and compiles once more. Numbers equal the eager
    step's up to the compiler's own rounding (it fuses elementwise ops and reorders sums;
    Triton kernels and custom ops are the same).

    Differentiate it as a first-order step: `psf.run_step`, `psf.value_and_grad` over
    ``step.attempt``, or ``loss.backward()``. ``torch.func.grad``/``vjp`` over a compiled step
    is refused (PyTorch's compiler does not run psf's backward under them).

    Args:
        step: the `StashAwareStep` (`psf.stash_aware`) to compile.
        **compile_kwargs: passed to ``torch.compile`` (``backend``, ``mode``, ``options``);
            ``fullgraph`` defaults to True, so that anything that would split the graph is an
            error rather than a slow step, and ``dynamic`` to False (shapes are static: a
            batch of another shape takes a state of its own).

    Returns:
        A `CompiledStep`.

    Raises:
        TypeError: ``step`` is not a `StashAwareStep`, or is compiled already.
        ValueError: ``step`` pages into a pool shared by its layers (``pool_scope="state"``;
            use ``"layer"``), ``dynamic=True``, or ``backend="eager"`` with the stash.

    Example::

        step = psf.compile(psf.stash_aware(loss_fn, cfg))
        state = step.init(params, batch)
        res = psf.run_step(step, params, batch, state)
    """
    return CompiledStep(step, compile_kwargs)


def _own_code():
    """A function that runs `StashAwareStep._step`, with a code object of its own: the
    compiler keeps its graphs, guards and recompile count per code object, so that two
    compiled steps (a train and an eval step, two factors) never share them."""
    code = _traced.__code__
    own = code.replace(co_name=f"{code.co_name}_{next(_NUMBERS)}")
    return types.FunctionType(own, _traced.__globals__, own.co_name)


def _traced(step, params, batch, state, fresh):
    return StashAwareStep._step(step, params, batch, state, fresh)


_NUMBERS = itertools.count()


def _refuse_generators(batch) -> None:
    if any(isinstance(leaf, torch.Generator) for leaf in torch.utils._pytree.tree_leaves(batch)):
        raise ValueError(
            "a torch.Generator in the batch of a compiled step: the compiler cannot take one. "
            "Draw the step's randomness outside it (pass the drawn tensors in the batch), or "
            "run the step uncompiled, where generators in the batch are rewound for a rerun")


def _check_compilable(step, compile_kwargs=None) -> None:
    if isinstance(step, CompiledStep):
        raise TypeError("this step is compiled already: psf.compile takes the "
                        "psf.stash_aware step itself")
    if not isinstance(step, StashAwareStep):
        raise TypeError(f"psf.compile takes a step made by psf.stash_aware(loss_fn, cfg), got "
                        f"{type(step).__name__}")
    if step.cfg.paged_stash and step.cfg.pool_scope != "layer":
        raise ValueError(
            "psf.compile stashes into pools of each layer's own: build the step with "
            "StashConfig(..., pool_scope='layer'). A pool shared by the layers "
            "(pool_scope='state') is written by every layer's forward while earlier layers' "
            "pages wait for their backward; a compiler reasons about a tensor's value, not "
            "about which pages are free, so it would keep a copy of the whole pool per layer.")
    kwargs = compile_kwargs or {}
    if kwargs.get("dynamic"):
        raise ValueError("psf.compile compiles static shapes (dynamic=False): a step's "
                         "buffers are sized for one batch shape, so a batch of another shape "
                         "takes a state of its own (step.init) and compiles once for it")
    if kwargs.get("backend") == "eager" and step.cfg.paged_stash:
        raise ValueError("backend='eager' does not go through AOTAutograd, which psf needs to "
                         "guard a stashing step's pages (see CompiledStep): use the default "
                         "'inductor', or 'aot_eager' to debug")
