"""Every public function and class, and the methods users call, documents its arguments and
what it returns in the Google sections the reference renders as tables.

The docstrings are read as mkdocstrings reads them: loaded statically by griffe and parsed
with its Google parser. Per name: an ``Args:`` section naming every parameter of the signature
(a dataclass's or named tuple's fields, the parameters of its generated ``__init__``, under
``Attributes:``), a ``Returns:`` section unless the function returns ``None``, and no parser
warning (an entry for a parameter the signature lacks, say).
"""

import dataclasses
import inspect
import logging
import pathlib
import re

import pytest

griffe = pytest.importorskip("griffe", reason="the docs extra's griffe reads the docstrings")

import pagedstash_func as psf  # noqa: E402

ROOT = pathlib.Path(__file__).parent.parent

NOT_DOCUMENTED_HERE = {"kernels": "a submodule (docs/reference/kernels.md)",
                       "PARAM_NAMES": "a constant", "STASHED": "a constant"}

# The public methods users call, per public class.
METHODS = {
    "StashState": ("check_alive", "clone", "spec"),
    "StashConfig": ("factor_for",),
    "Router": ("check",),
    "RouterStats": ("counts",),
    "StashAwareStep": ("init", "__call__", "attempt", "exact"),
    "GraphedStep": ("__call__", "prepare", "attempt", "clear"),
    "Ladder": ("fitting_rung", "quantile_rung", "allowed", "decide", "prepare",
               "decide_layers"),
    "AdaptiveStep": ("init", "__call__", "warm", "step_at", "factor", "factor_of",
                     "save_step", "load", "replay"),
    "RoutingProfile": ("add", "recommend", "table"),
}

# Functions that return None without an annotation saying so: none today. An entry names
# the function and why it needs no Returns section.
RETURNS_NOTHING: dict[str, str] = {}


def public_names() -> list[str]:
    return [n for n in psf.__all__ if n not in NOT_DOCUMENTED_HERE]


def documented() -> list[tuple[str, object]]:
    """``(label, object)`` of every function, class and listed method."""
    out = []
    for name in public_names():
        obj = getattr(psf, name)
        assert inspect.isclass(obj) or inspect.isfunction(obj), \
            f"psf.{name} is a {type(obj).__name__}: list it in NOT_DOCUMENTED_HERE with why"
        out.append((name, obj))
        for method in METHODS.get(name, ()):
            out.append((f"{name}.{method}", getattr(obj, method)))
    return out


@pytest.fixture(scope="module")
def package():
    return griffe.load("pagedstash_func", search_paths=[str(ROOT)])


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def sections(package, obj) -> tuple[dict, list[str]]:
    """``({kind: section}, parser warnings)`` of ``obj``'s docstring, found in griffe's
    static view by the path that defines it (the name it is re-exported under may be
    shadowed there by a subpackage: ``psf.stash``)."""
    path = f"{obj.__module__}.{obj.__qualname__}".removeprefix("pagedstash_func.")
    node = package[path]
    assert node.docstring is not None, f"{path} has no docstring"
    catch = _Warnings()
    log = logging.getLogger("griffe")
    log.addHandler(catch)
    try:
        parsed = node.docstring.parse("google", warn_missing_types=False)
    finally:
        log.removeHandler(catch)
    found = {}
    for section in parsed:
        assert section.kind.value not in found or section.kind.value == "text", \
            f"{path} has two {section.kind.value} sections"
        # a section entry indented as prose ends its section and shows as a loose paragraph
        stray = section.kind.value == "text" and re.search(
            r"^\s*(\w+Error|Args|Returns|Raises|Attributes):", section.value, re.M)
        assert not stray, f"{path}: {stray.group(0).strip()!r} is outside its section"
        found.setdefault(section.kind.value, section)     # the first text: the summary
    return found, catch.messages


def is_record(cls) -> bool:
    """A dataclass or a named tuple: its constructor's parameters are its fields."""
    return dataclasses.is_dataclass(cls) or (issubclass(cls, tuple) and hasattr(cls, "_fields"))


def parameters(obj) -> list[str]:
    """The parameters a docstring must name: the signature's, less ``self``, ``*args`` and
    ``**kwargs`` (documented where they mean something, not required) and private ones."""
    try:
        sig = inspect.signature(obj)
    except ValueError:                  # a builtin constructor (an exception, a dict)
        return []
    return [p.name for p in sig.parameters.values()
            if p.name not in ("self", "cls") and not p.name.startswith("_")
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def returns_none(label: str, obj) -> bool:
    if label in RETURNS_NOTHING:
        return True
    annotation = inspect.signature(obj).return_annotation
    return annotation is None or annotation == "None"


@pytest.mark.parametrize("label,obj", documented(), ids=[label for label, _ in documented()])
def test_docstring_has_its_sections(package, label, obj):
    found, warnings = sections(package, obj)
    assert not warnings, f"{label}: the Google parser warns: {warnings}"
    summary = found.get("text")
    assert summary is not None and summary.value.strip(), f"{label} has no summary line"
    if inspect.isclass(obj) and is_record(obj):
        fields = parameters(obj)
        attributes = found.get("attributes")
        assert attributes is not None, f"{label} has no Attributes: section for its fields"
        named = [a.name for a in attributes.value]
        missing = [f for f in fields if f not in named]
        assert not missing, f"{label}: Attributes: lacks the fields {missing}"
        return
    wanted = parameters(obj)
    given = found.get("parameters")
    if wanted:
        assert given is not None, f"{label} has no Args: section for {wanted}"
        named = [p.name for p in given.value]
        missing = [p for p in wanted if p not in named]
        assert not missing, f"{label}: Args: lacks {missing}"
    if inspect.isclass(obj):
        return
    if returns_none(label, obj):
        assert "returns" not in found, f"{label} returns None but has a Returns: section"
    else:
        assert "returns" in found, f"{label} has no Returns: section"


def test_every_public_name_is_checked():
    """A name added to ``__all__`` is checked here, or listed above with why it is not."""
    unknown = sorted(set(NOT_DOCUMENTED_HERE) - set(psf.__all__))
    assert not unknown, f"NOT_DOCUMENTED_HERE names what psf does not export: {unknown}"
    for cls, methods in METHODS.items():
        assert cls in psf.__all__, f"METHODS lists {cls}, which psf does not export"
        for method in methods:
            assert callable(getattr(getattr(psf, cls), method, None)), f"{cls}.{method}"
