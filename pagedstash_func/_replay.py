"""Record a step's inputs to a file and replay them, bit for bit under deterministic mode."""

from __future__ import annotations

import platform

import torch
import torch.utils._pytree as pytree

from ._runner import StepResult, run_step
from ._state import StashState
from ._transform import StashAwareStep, stash_aware


def save_step(path, step: StashAwareStep, params, batch, state: StashState) -> None:
    """Write ``params``, ``batch`` (seeds included), ``state`` and the config to ``path``.

    Call it before the step consumes ``state``. The file is a pickle (``torch.save``): load
    only files you wrote.
    """
    state.check_alive()
    torch.save({"params": params, "batch": batch, "state": state.clone(), "cfg": step.cfg,
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "versions": {"torch": torch.__version__, "python": platform.python_version()}},
               path)


def load_step(path, loss_fn, *, device=None):
    """``(step, params, batch, state)`` from a `save_step` file, on ``device`` if given."""
    saved = torch.load(path, weights_only=False, map_location=device)
    state = saved["state"]
    if device is not None or any(t.is_cuda for t in pytree.tree_leaves(state)):
        state = _repin_host_pools(state)
    return stash_aware(loss_fn, saved["cfg"]), saved["params"], saved["batch"], state


def replay_step(path, loss_fn, *, device=None) -> StepResult:
    """Run `run_step` again on the inputs saved in ``path``."""
    step, params, batch, state = load_step(path, loss_fn, device=device)
    return run_step(step, params, batch, state)


def _repin_host_pools(state: StashState) -> StashState:
    # torch.load gives back plain host memory; the CUDA kernels read the host pool only when
    # it is pinned.
    pools = {}
    for lay in state.layouts:
        pool = state.pools[lay.key]
        host = pool.host
        if lay.host_pages and host.device.type == "cpu" and not host.is_pinned():
            host = host.pin_memory()
        pools[lay.key] = pool._replace(host=host)
    return state.successor(pools=pools)
