"""Record a step's inputs to a file and replay them, bit for bit under deterministic mode.

The file holds tensors, plain containers and a fixed set of tagged values (numbers, strings,
``torch.Generator`` states, dtypes, the config's fields, the state's layout), written with
``torch.save`` and read with ``torch.load(weights_only=True)``: loading runs no code from the
file. A loaded state is validated completely (`validate_state`) before any kernel sees it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import platform

import torch
import torch.utils._pytree as pytree

from ..core._config import StashConfig
from ..core._files import save_atomic
from ..parallel._placement import ExpertShard
from ..core._frame import LayerInfo
from ..stash._pools import PoolLayout, StashSpec
from ._identity import loss_identity
from ._runner import StepResult, run_step
from ..stash._state import Pool, StashState
from ._transform import StashAwareStep, stash_aware
from ..stash._validate import validate_state

FORMAT, VERSION = "pagedstash_func.step", 3     # 3: the policy entry (adaptive steps)


def save_step(path, step: StashAwareStep, params, batch, state: StashState, *,
              check_loss_fn: bool = True, policy=None) -> None:
    """Write a step's inputs to ``path``, to replay them later bit for bit.

    The file holds ``params``, ``batch`` (seeds and generators included), ``state``, the config
    and a digest of what the loss function computes (`loss_identity`: its code, defaults and
    the values it closes over). An expert-parallel step's file records this rank and the world
    size, and replays only there. Call it before the step consumes ``state``. The file is
    written atomically: a save killed part-way leaves the file that was there whole.

    Args:
        path: the file to write.
        step: the `StashAwareStep` whose next step this is.
        params: the parameters; tensors, numbers, strings, ``None``, ``torch.Generator``,
            dtypes, and lists, tuples and dicts of those (anything else is refused here, naming
            where it sits: a file that loads only what it can describe executes nothing when
            loaded).
        batch: the batch; the same kinds of values as ``params``.
        state: the live `StashState` the step will take, between steps (not consumed).
        check_loss_fn: record the loss digest; ``False`` leaves it out, for a loss that closes
            over a value it cannot digest.
        policy: such values too, kept with the step (an adaptive step's rung and history:
            `AdaptiveStep.save_step`); `load_policy` reads them back.

    Raises:
        ValueError: ``state`` holds stashes whose backward has not run.
        TypeError: ``params``, ``batch`` or ``policy`` holds a value a step file cannot store.
        ConsumedStateError: ``state`` was consumed already.
    """
    state.check_alive()
    if state.pending:
        raise ValueError("save_step needs a state between steps: this one holds stashes whose "
                         "backward has not run (save before the step, or after its backward)")
    spread = any(info.group_size > 1 for info in state.layers)
    where = (torch.distributed.get_rank(), torch.distributed.get_world_size()) \
        if spread and torch.distributed.is_initialized() else None
    payload = {"format": FORMAT, "version": VERSION, "loss_fn": _qualname(step.loss_fn),
               "loss_digest": loss_identity(step.loss_fn) if check_loss_fn else None,
               "rank_of": list(where) if where else None,
               "cfg": dataclasses.asdict(step.cfg), "params": _encode(params, "params"),
               "policy": _encode(policy, "policy"),
               "batch": _encode(batch, "batch"), "state": _encode_state(state),
               "deterministic": torch.are_deterministic_algorithms_enabled(),
               "versions": {"torch": str(torch.__version__),
                            "python": platform.python_version(),
                            "bytecode": _bytecode_version()}}
    payload["checksum"] = _checksum(payload)
    save_atomic(payload, path)          # killed part-way: the file that was there stays whole


def load_step(path, loss_fn, *, device=None, check_loss_fn: bool = True):
    """``(step, params, batch, state)`` from a `save_step` file, on ``device`` if given.

    The file is read with ``torch.load(weights_only=True)`` (nothing in it runs) and its state
    validated completely (`validate_state`) before any kernel sees it.

    Args:
        path: the file `save_step` wrote.
        loss_fn: the loss the file was saved with.
        device: where the tensors go (default: where they were saved).
        check_loss_fn: compare ``loss_fn``'s digest with the file's (``False``: replay with
            another loss on purpose).

    Returns:
        ``(step, params, batch, state)``: a `StashAwareStep` of ``loss_fn`` and the saved
            config, the saved ``params`` and ``batch``, and a live `StashState`.

    Raises:
        ValueError: a truncated or foreign file, a state that breaks the page invariants
            (naming the field), or ``loss_fn`` that is not the function the file was saved
            with (pass ``check_loss_fn=False`` to replay with another one on purpose).
    """
    saved = _read_checked(path, device)
    if check_loss_fn:
        _check_loss(path, saved, loss_fn)
    _check_rank(path, saved.get("rank_of"))
    try:
        cfg = StashConfig(**saved["cfg"])
        params, batch = _decode(saved["params"]), _decode(saved["batch"])
        state = _decode_state(saved["state"])
        validate_state(state, where="state", between_steps=True)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    except Exception as err:       # a malformed entry: KeyError, TypeError, a RuntimeError ...
        first = (str(err).splitlines() or [""])[0][:200]
        raise ValueError(f"{path}: a malformed step file ({type(err).__name__}: {first})") \
            from None
    return stash_aware(loss_fn, cfg), params, batch, _repin_host_pools(state)


def replay_step(path, loss_fn, *, device=None, check_loss_fn: bool = True,
                group=None) -> StepResult:
    """Run `run_step` again on the inputs saved in ``path``.

    Args:
        path: the file `save_step` wrote.
        loss_fn: the loss the file was saved with.
        device: as `load_step` takes it.
        check_loss_fn: as `load_step` takes it.
        group: as `run_step` takes it (a step whose layers use several process groups was run
            with one that spans them, and replays with it too).

    Returns:
        The `StepResult` of the replayed step.

    Raises:
        ValueError: as `load_step` refuses the file.
    """
    step, params, batch, state = load_step(path, loss_fn, device=device,
                                           check_loss_fn=check_loss_fn)
    return run_step(step, params, batch, state, group=group)


def _checksum(payload) -> str:
    """SHA-256 of every tensor's bytes (with its dtype and shape) and every plain value, in
    the payload's order: any changed byte or entry changes it."""
    digest = hashlib.sha256()

    def walk(node):
        if isinstance(node, torch.Tensor):
            digest.update(f"{node.dtype}{tuple(node.shape)}".encode())
            digest.update(node.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                          .numpy().tobytes())
        elif isinstance(node, dict):
            for key, value in node.items():
                digest.update(repr(key).encode())
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)
        else:
            digest.update(repr(node).encode())
    walk(payload)
    return digest.hexdigest()


def _check_loss(path, saved: dict, loss_fn) -> None:
    """The file's loss digest against ``loss_fn``'s, on the Python version that wrote it."""
    name = saved.get("loss_fn")
    if saved.get("loss_digest") is None:
        raise ValueError(f"{path} was saved with check_loss_fn=False, so it cannot tell which "
                         f"loss it ran ({name}): pass check_loss_fn=False to replay it")
    wrote = saved.get("versions", {}).get("bytecode")
    if wrote != _bytecode_version():
        raise ValueError(f"{path} was written by Python {saved.get('versions', {}).get('python')}"
                         f"; its loss digest covers bytecode, which differs between Python "
                         f"versions, so it is compared only where the bytecode is the same: pass "
                         f"check_loss_fn=False to replay it on {platform.python_version()}")
    if saved["loss_digest"] != loss_identity(loss_fn):
        raise ValueError(f"{path} was saved with the loss {name}, not this "
                         f"{_qualname(loss_fn)} (their code, defaults or closed-over values "
                         f"differ): "
                         f"replaying another loss gives other numbers; pass "
                         f"check_loss_fn=False to do it on purpose")


def _bytecode_version() -> str:
    """Python's minor version and bytecode magic number: what a loss digest depends on."""
    import importlib.util
    import sys
    return f"{sys.version_info[0]}.{sys.version_info[1]}:{importlib.util.MAGIC_NUMBER.hex()}"


def _check_rank(path, rank_of) -> None:
    """An expert-parallel step's file replays on the rank and world size that wrote it."""
    if rank_of is None:
        return
    rank, world = rank_of
    here = (torch.distributed.get_rank(), torch.distributed.get_world_size()) \
        if torch.distributed.is_initialized() else None
    if here != (rank, world):
        now = f"rank {here[0]} of {here[1]}" if here else "a process outside torch.distributed"
        raise ValueError(f"{path} is rank {rank}'s file of an expert-parallel step over {world} "
                         f"ranks, and this is {now}: replay each rank's own file on that rank, "
                         f"in a world of that size (its experts are that rank's shard)")


def _qualname(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


# ----------------------------------------------------------------------------- trees


def _encode(obj, where: str):
    if isinstance(obj, torch.Tensor):
        return {"t": "tensor", "v": obj.detach()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"t": "py", "v": obj}
    if isinstance(obj, torch.dtype):
        return {"t": "dtype", "v": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.Generator):
        return {"t": "generator", "device": str(obj.device), "v": obj.get_state()}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise TypeError(f"{where} has a key that is not a str or int: only those are stored")
        kind = "expert_shard" if isinstance(obj, ExpertShard) else "dict"
        return {"t": kind, "k": list(obj), "v": [_encode(v, f"{where}[{k!r}]")
                                                for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"t": type(obj).__name__, "v": [_encode(v, f"{where}[{i}]")
                                               for i, v in enumerate(obj)]}
    raise TypeError(f"{where} is a {type(obj).__name__}, which a step file cannot store (it "
                    f"holds tensors, numbers, strings, None, torch.Generator, dtypes and lists, "
                    f"tuples and dicts of those): convert it, e.g. to a tensor")


def _decode(node):
    kind = node["t"]
    if kind in ("tensor", "py"):
        return node["v"]
    if kind == "dtype":
        return _dtype(node["v"])
    if kind == "generator":
        gen = torch.Generator(device=node["device"])
        gen.set_state(node["v"])
        return gen
    if kind in ("dict", "expert_shard"):
        out = {k: _decode(v) for k, v in zip(node["k"], node["v"])}
        return ExpertShard(out) if kind == "expert_shard" else out
    if kind in ("list", "tuple"):
        items = [_decode(v) for v in node["v"]]
        return items if kind == "list" else tuple(items)
    raise ValueError(f"unknown entry {kind!r} in a step file")


def _dtype(name) -> torch.dtype:
    """The ``torch.dtype`` a step file names (``"float32"``); anything else, a function or
    class of torch's included, is refused: a file names data, never code."""
    found = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(found, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return found


# ----------------------------------------------------------------------------- the state


def _encode_state(state: StashState) -> dict:
    def fields(x):
        return {k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v
                for k, v in dataclasses.asdict(x).items()}
    return {"leaves": [t.detach() for t in pytree.tree_leaves(state)],
            "layouts": [fields(lay) for lay in state.layouts],
            "specs": [fields(spec) for spec in state.specs],
            "counts": list(state.counts), "page_size": state.page_size,
            "backend": state.backend, "layers": [fields(info) for info in state.layers],
            "layer_pools": [[name, fields(lay)] for name, lay in state.layer_pools.items()]}


def _decode_state(saved: dict) -> StashState:
    def build(cls, fields):
        return cls(**{k: _dtype(v) if k == "dtype" else v for k, v in fields.items()})
    layouts = tuple(build(PoolLayout, f) for f in saved["layouts"])
    specs = tuple(build(StashSpec, f) for f in saved["specs"])
    leaves = list(saved["leaves"])
    want = 1 + 4 * len(layouts) + len(specs) + len(saved["counts"])
    if len(leaves) != want:
        raise ValueError(f"state holds {len(leaves)} leaves; its layout needs {want}")
    if not all(isinstance(t, torch.Tensor) for t in leaves):
        raise ValueError("state holds a leaf that is not a tensor")
    flags, at = leaves[0], 1
    pools = {}
    for lay in layouts:
        pools[lay.key] = Pool(*leaves[at:at + 4])
        at += 4
    tables = {s.name: leaves[at + i] for i, s in enumerate(specs)}
    at += len(specs)
    counts = {name: leaves[at + i] for i, name in enumerate(saved["counts"])}
    return StashState.create(pools=pools, tables=tables, flags=flags, counts=counts,
                             layouts=layouts, specs=specs, page_size=saved["page_size"],
                             backend=saved["backend"],
                             layers=tuple(build(LayerInfo, f) for f in saved["layers"]),
                             layer_pools=tuple((name, build(PoolLayout, f))
                                               for name, f in saved.get("layer_pools", [])))


def _repin_host_pools(state: StashState) -> StashState:
    # torch.load gives back plain host memory; the CUDA kernels read the host pool only when
    # it is pinned.
    if not any(t.is_cuda for t in pytree.tree_leaves(state)):
        return state
    pools = {}
    for lay in state.layouts:
        pool = state.pools[lay.key]
        host = pool.host
        if lay.host_pages and host.device.type == "cpu" and not host.is_pinned():
            host = host.pin_memory()
        pools[lay.key] = pool._replace(host=host)
    return state.successor(pools=pools)


def load_policy(path):
    """The ``policy`` values `save_step` wrote with the step in ``path``.

    The same checks as `load_step` run first (format, version, checksum).

    Args:
        path: the file `save_step` wrote.

    Returns:
        The policy values, or ``None`` if none were saved.

    Raises:
        ValueError: the file is not a readable step file, or its policy entry is malformed.
    """
    saved = _read_checked(path, None)
    try:
        return _decode(saved["policy"])
    except Exception as err:
        raise ValueError(f"{path}: a malformed policy entry ({type(err).__name__})") from None


def _read_checked(path, device) -> dict:
    """The payload of a step file, its marker, version and checksum checked (`ValueError`
    naming what is wrong); the checksum entry taken out."""
    try:
        saved = torch.load(path, weights_only=True, map_location=device)
    except Exception as err:        # truncated zip, foreign pickle, unknown global ...
        first = (str(err).splitlines() or [""])[0][:200]
        raise ValueError(f"{path} is not a readable pagedstash_func step file "
                         f"({type(err).__name__}: {first})") from None
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(f"{path} is not a pagedstash_func step file (no {FORMAT!r} marker)")
    if saved.get("version") != VERSION:
        raise ValueError(f"{path} is a step file of version {saved.get('version')}; this "
                         f"library reads version {VERSION}")
    if saved.pop("checksum", None) != _checksum(saved):
        raise ValueError(f"{path} is corrupted: its contents do not match the checksum written "
                         f"with them (a changed byte in a tensor, or a missing entry)")
    return saved
