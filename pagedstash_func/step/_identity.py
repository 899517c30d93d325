"""What a loss function computes, as a digest: how a step file knows it is replayed with the
function it was saved with.

A name is not enough: two closures of one factory with different constants, any two lambdas,
any two ``functools.partial`` objects share one. The digest covers a function's code (its
bytecode, constants and names, nested code included), its defaults, and the values it closes
over; a ``partial``'s function and arguments; and for an object that says what it computes
(``__psf_identity__()``, as `from_hf_model`'s loss does: the model's class, config and
parameter names), that. Values are digested when they are tensors (dtype, shape, bytes),
numbers, strings, ``None``, dtypes, functions, process groups (by the ranks they span), or
lists, tuples and dicts of those; anything
else raises `ValueError` naming it. Bytecode differs between Python versions, so a digest is
only compared on the version that wrote it.
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools
import hashlib
import numbers
import types

import torch


def loss_identity(fn) -> str:
    """A hex digest of what ``fn`` computes; `ValueError` naming a value it cannot digest."""
    digest = hashlib.sha256()
    _walk(fn, digest, "the loss", set())
    return digest.hexdigest()


def _walk(obj, digest, where: str, seen: set) -> None:
    """Digest ``obj``; ``seen`` holds the ids of the containers and functions being walked
    (its ancestors only, so a shared or temporary object is walked each time it appears)."""
    tracked = isinstance(obj, (list, tuple, dict, set, frozenset, types.FunctionType)) or (
        dataclasses.is_dataclass(obj) and not isinstance(obj, type))
    if tracked:
        if id(obj) in seen:                      # a container or function that holds itself
            digest.update(b"cycle;")
            return
        seen.add(id(obj))
    try:
        _walk_one(obj, digest, where, seen)
    finally:
        if tracked:
            seen.discard(id(obj))


def _walk_one(obj, digest, where: str, seen: set) -> None:
    atom = _atom(obj)
    if atom is not None:
        digest.update(atom.encode())
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        digest.update(f"tensor:{t.dtype}{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif not (_walk_container(obj, digest, where, seen)
              or _walk_callable(obj, digest, where, seen)):
        raise ValueError(
            f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which a step file "
            f"cannot identify: the check that a replay runs the saved loss digests functions, "
            f"tensors, numbers, strings and containers of them. Pass check_loss_fn=False to "
            f"save and replay without the check (or give the object a __psf_identity__() that "
            f"returns such values)")


def _atom(obj) -> str | None:
    """The text that identifies a value with nothing inside to walk (numbers, strings,
    devices, dtypes, classes, ops, modules, process groups), or None."""
    if obj is None or obj is Ellipsis or obj is NotImplemented:
        return f"{obj!r};"
    if isinstance(obj, torch.device):
        return f"device:{obj};"
    if isinstance(obj, (bool, int, float, complex, str, bytes)):
        return f"{type(obj).__name__}:{obj!r};"
    if isinstance(obj, enum.Enum):
        return f"enum:{type(obj).__qualname__}.{obj.name};"
    if isinstance(obj, numbers.Number) and hasattr(obj, "item"):     # numpy scalars
        return f"{type(obj).__name__}:{obj.item()!r};"
    if isinstance(obj, (range, slice, bytearray)):
        return f"{type(obj).__name__}:{obj!r};"
    if isinstance(obj, type):
        return f"class:{obj.__module__}.{obj.__qualname__};"
    if isinstance(obj, torch.Generator):       # its state moves as it draws: by kind only
        return f"generator:{obj.device};"
    if type(obj).__module__.startswith("torch._ops"):
        return f"torch op:{obj};"
    if isinstance(obj, torch.dtype):
        return f"dtype:{obj};"
    if _is_process_group(obj):                 # by the ranks it spans
        return f"process group:{tuple(torch.distributed.get_process_group_ranks(obj))};"
    if isinstance(obj, (types.BuiltinFunctionType, types.ModuleType)):
        return f"{type(obj).__name__}:{getattr(obj, '__module__', '')}.{obj.__name__};"
    return None


def _walk_container(obj, digest, where: str, seen: set) -> bool:
    """Digest a set, dataclass, list, tuple or dict and what it holds; False for others."""
    put = digest.update
    if isinstance(obj, (set, frozenset)):
        put(f"{type(obj).__name__}[{len(obj)}];".encode())
        for value in sorted(obj, key=repr):
            _walk(value, digest, f"{where} element", seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        put(f"dataclass:{type(obj).__module__}.{type(obj).__qualname__};".encode())
        for field in dataclasses.fields(obj):
            _walk(getattr(obj, field.name), digest, f"{where}.{field.name}", seen)
    elif isinstance(obj, (list, tuple)):
        put(f"{type(obj).__name__}[{len(obj)}];".encode())
        for i, value in enumerate(obj):
            _walk(value, digest, f"{where}[{i}]", seen)
    elif isinstance(obj, dict):
        put(f"dict[{len(obj)}];".encode())
        for key, value in obj.items():
            _walk(key, digest, f"{where} key", seen)
            _walk(value, digest, f"{where}[{key!r}]", seen)
    else:
        return False
    return True


def _walk_callable(obj, digest, where: str, seen: set) -> bool:
    """Digest code, a partial, a method, a function (code, defaults, closure, the globals
    it names) or an object's ``__psf_identity__()``; False for others."""
    put = digest.update
    if isinstance(obj, types.CodeType):
        _code(obj, digest, where, seen)
    elif isinstance(obj, functools.partial):
        put(b"partial;")
        _walk(obj.func, digest, f"{where}.func", seen)
        _walk(obj.args, digest, f"{where}.args", seen)
        _walk(obj.keywords, digest, f"{where}.keywords", seen)
    elif isinstance(obj, types.MethodType):
        put(b"method;")
        _walk(obj.__func__, digest, f"{where}.__func__", seen)
        _walk(obj.__self__, digest, f"{where}.__self__", seen)
    elif isinstance(obj, types.FunctionType):
        put(f"function:{obj.__module__}.{obj.__qualname__};".encode())
        _code(obj.__code__, digest, f"{where} ({obj.__qualname__})", seen)
        _walk(obj.__defaults__, digest, f"{where} defaults", seen)
        _walk(obj.__kwdefaults__, digest, f"{where} keyword defaults", seen)
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:                   # a cell not filled yet
                value = None
            _walk(value, digest, f"{where} ({obj.__qualname__}) closure {name!r}", seen)
        _globals(obj, digest, where, seen)
    elif callable(getattr(obj, "__psf_identity__", None)):
        put(f"object:{type(obj).__module__}.{type(obj).__qualname__};".encode())
        _walk(obj.__psf_identity__(), digest, f"{where}.__psf_identity__()", seen)
    else:
        return False
    return True


def _globals(fn, digest, where: str, seen: set) -> None:
    """The module globals ``fn``'s code names (nested code included): values it can digest
    are digested; anything else (modules, objects) is taken by its name only."""
    names = set()
    stack = [fn.__code__]
    while stack:                 # global loads only: an attribute's name is no global
        code = stack.pop()
        names.update(i.argval for i in dis.get_instructions(code)
                     if i.opname in ("LOAD_GLOBAL", "LOAD_NAME"))
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    for name in sorted(names):
        if name not in fn.__globals__:
            continue
        value = fn.__globals__[name]
        inner = hashlib.sha256()
        try:
            _walk(value, inner, f"{where} global {name!r}", seen)
        except (ValueError, RecursionError):
            continue                         # not a value this digest reads: by name only
        digest.update(f"global:{name};".encode())
        digest.update(inner.digest())


def _is_process_group(obj) -> bool:
    dist = torch.distributed
    return dist.is_available() and isinstance(obj, dist.ProcessGroup)


def _code(code: types.CodeType, digest, where: str, seen: set) -> None:
    digest.update(code.co_code)
    digest.update(repr((code.co_names, code.co_varnames, code.co_freevars,
                        code.co_argcount, code.co_kwonlyargcount)).encode())
    for const in code.co_consts:
        _walk(const, digest, f"{where} constant", seen)
