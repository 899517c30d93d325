"""The layering of the package holds (docs/concepts/layout.md): every module sits in a part, imports run
one way between the parts, no module takes another module's private name, the command line
uses public names only, and each kernel file stands alone."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).parent.parent
PKG = ROOT / "pagedstash_func"

# The parts, lowest first: a module may import its own part and the parts below it.
ORDER = ["kernels", "core", "stash", "experts", "parallel", "layer", "step", "interop", "cli"]
TOP = {"__main__"}     # with the package itself (its re-exports): the `python -m` entry


def modules():
    """``(dotted name, path)`` of every module of the package."""
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("").parts
        yield ".".join(("pagedstash_func",) + rel[:-1 if rel[-1] == "__init__" else None]), path


MODULES = {dotted for dotted, _ in modules()}


def part_of(dotted: str) -> str:
    """The part of a module (``pagedstash_func.stash._state`` -> ``stash``); a module outside
    every part fails the test rather than escaping it."""
    parts = dotted.split(".")
    if dotted == "pagedstash_func" or (len(parts) == 2 and parts[1] in TOP):
        return "top"
    assert parts[1] in ORDER, f"{dotted} is in no part of the layout ({', '.join(ORDER)})"
    return parts[1]


def imports(dotted: str, path: pathlib.Path):
    """``(module imported, names taken)`` of every import of the package in ``path``, resolved to
    absolute names: ``from .x import a``, ``from ..x import a``, ``from . import x``,
    ``import pagedstash_func.x`` and ``from pagedstash_func.x import a``."""
    package = dotted if path.name == "__init__.py" else dotted.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("pagedstash_func"):
                continue
            names = [a.name for a in node.names]
            submodules = [n for n in names if node.module is None or f"{mod}.{n}" in MODULES]
            for n in submodules:             # from . import x, from ..core import _frame
                yield f"{mod}.{n}", []
            if len(submodules) < len(names):
                yield mod, [n for n in names if n not in submodules]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("pagedstash_func"):
                    yield a.name, []


def rank(part: str) -> int:
    return len(ORDER) if part == "top" else ORDER.index(part)


def test_every_module_is_placed_and_imports_run_one_way():
    seen = set()
    for dotted, path in modules():
        me = part_of(dotted)
        seen.add(me)
        for mod, names in imports(dotted, path):
            private = [n for n in names if n.startswith("_") and n != "__version__"]
            assert not private, f"{dotted} imports private {private} from {mod}"
            if me == "cli" and mod.split(".")[1:2] != ["cli"]:
                assert mod == "pagedstash_func", \
                    f"the command line module {dotted} imports {mod}: use psf names"
                continue
            if me == "top":
                continue                       # __init__ re-exports; __main__ starts the cli
            there = part_of(mod)
            assert there != "top" or me == "cli", f"{dotted} imports the package top ({mod})"
            assert rank(there) <= rank(me), \
                f"{dotted} ({me}) imports {mod} ({there}): imports run {' < '.join(ORDER)}"
    assert seen >= set(ORDER), f"parts with no module: {set(ORDER) - seen}"


def test_the_library_never_imports_the_command_line():
    for dotted, path in modules():
        if part_of(dotted) in ("cli", "top"):
            continue
        for mod, _ in imports(dotted, path):
            assert ".cli" not in mod, f"{dotted} imports the command line ({mod})"


def test_the_checker_sees_relative_and_absolute_imports(tmp_path):
    """The walker resolves every import form, so a wrong-way import cannot hide in one."""
    src = tmp_path / "m.py"
    src.write_text("from . import _x\nfrom ..step._runner import run_step\n"
                   "import pagedstash_func.cli._main\nfrom pagedstash_func.layer import _moe\n"
                   "from ..layer._moe import _hidden, moe\n"
                   "def f():\n    from ..core import _frame\n")
    got = list(imports("pagedstash_func.stash._m", src))
    assert got == [("pagedstash_func.stash._x", []),
                   ("pagedstash_func.step._runner", ["run_step"]),
                   ("pagedstash_func.cli._main", []),
                   ("pagedstash_func.layer._moe", []),
                   ("pagedstash_func.layer._moe", ["_hidden", "moe"]),
                   ("pagedstash_func.core._frame", [])]


def test_the_kernels_package_is_held_to_its_place(tmp_path):
    """An upward import in kernels/__init__.py resolves to the part it names."""
    init = tmp_path / "__init__.py"
    init.write_text("from ..step._runner import run_step\n")
    assert list(imports("pagedstash_func.kernels", init)) == [
        ("pagedstash_func.step._runner", ["run_step"])]
    assert part_of("pagedstash_func.step._runner") == "step"


def test_each_kernel_file_is_self_contained():
    """A kernel file imports the shared helper modules (``_layout``, ``_pagestack``, ...),
    never another kernel file."""
    for path in (PKG / "kernels").glob("*.py"):
        if path.stem.startswith("_"):
            continue
        for mod, _ in imports(f"pagedstash_func.kernels.{path.stem}", path):
            leaf = mod.split(".")[2] if mod.count(".") >= 2 else ""
            assert leaf.startswith("_"), f"kernels/{path.name} imports the kernel {mod}"


def test_no_module_imports_itself_round_a_circle():
    """Every import of the package, those inside functions too, as one graph: no cycle (a
    cycle inside a part is hidden from the order above, and breaks as soon as one of its
    imports moves to the top of its module)."""
    graph = {d: {m for m, _ in imports(d, p) if m in MODULES and m != d} for d, p in modules()}
    done, path = set(), []

    def visit(node):
        if node in path:
            raise AssertionError(" -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        path.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        path.pop()
        done.add(node)
    for node in sorted(graph):
        visit(node)


CODE_LINES = 60       # a function's lines, its docstring not counted


def test_functions_stay_short():
    """No function of the package runs over `CODE_LINES` lines besides its docstring (a
    public function's Args, Returns and Raises are its reference, not its length)."""
    long = []
    for dotted, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                        and isinstance(first.value.value, str):
                    lines -= first.end_lineno - first.lineno + 1
                if lines > CODE_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert not long, long
