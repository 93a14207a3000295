"""The package's shape, read from its source with ``ast`` (nothing is imported).

Four rules of the design (DESIGN.md, "The library"): no import cycles between modules; modules
use each other's public names only; ``runtime/`` is the floor and imports nothing above it; and an
import only runs down the layers (:data:`LAYERS`), at module level or inside a function alike.
Beside them: long modules say why, and every process-group parameter is annotated (mypy checks it).
Each rule is a plain function returning a list of problems (empty = fine); each is also run on a
small fake package that breaks it, so a rule that can never fail would be caught too.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1] / "minitorch_dist"


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module doing the import
    target: str  # dotted module imported (a submodule when ``from pkg import sub`` names one)
    name: str  # the name taken from ``target`` ("" for ``import x`` / a submodule import)
    line: int
    top_level: bool  # runs when the importer is imported (not inside a function, not TYPE_CHECKING)


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package at ``root`` (``pkg/a/__init__.py``: ``pkg.a``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _walk(node, top_level: bool):
    """(import node, top_level) for every import under ``node``; function bodies are not top level."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, top_level
        inner = top_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(child, ast.If) and _is_type_checking(child):
            inner = False
        yield from _walk(child, inner)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def collect_imports(root: Path) -> list[Import]:
    """Every import inside the package at ``root`` whose target is a module of that package."""
    modules = module_names(root)
    pkg = root.name
    out = []
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, top in _walk(tree, True):
            if isinstance(node, ast.Import):
                out += [Import(mod, a.name, "", node.lineno, top) for a in node.names
                        if a.name == pkg or a.name.startswith(pkg + ".")]
                continue
            base = _resolve(mod, path.name == "__init__.py", node)
            if not (base == pkg or base.startswith(pkg + ".")):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append(Import(mod, sub, "", node.lineno, top) if sub in modules
                           else Import(mod, base, a.name, node.lineno, top))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _parent(module: str) -> str:
    return module.rpartition(".")[0]


def private_import_problems(root: Path) -> list[str]:
    """Imports of another module's ``_private`` name, or of a ``_private`` module from outside the
    package that holds it (``kernels/_runtime.py`` is for ``kernels/`` only). Dunders are public."""
    problems = []
    for imp in collect_imports(root):
        where = f"{imp.importer}:{imp.line}"
        if imp.name and _private(imp.name) and imp.target != imp.importer:
            problems.append(f"{where} imports private name {imp.name!r} from {imp.target}")
        for i, part in enumerate(imp.target.split(".")):
            owner = ".".join(imp.target.split(".")[:i])
            if _private(part) and not (imp.importer == owner or imp.importer.startswith(owner + ".")):
                problems.append(f"{where} imports private module {imp.target} from outside {owner}")
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (or a self-loop), Tarjan's algorithm."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def import_cycle_problems(root: Path, top_level_only: bool = True) -> list[str]:
    """Cycles among module-level imports (with ``top_level_only=False``, imports inside functions
    count too: a function-level import that closes a loop only hides the cycle). ``from pkg import
    sub`` is an edge to ``pkg.sub``; ``from pkg import name`` (a name re-exported by
    ``pkg/__init__``) is an edge to ``pkg``. A package's ``__init__`` importing its own submodules
    is fine; a submodule importing back from its package's ``__init__`` closes a cycle."""
    graph: dict[str, set[str]] = {}
    for imp in collect_imports(root):
        if (imp.top_level or not top_level_only) and imp.target != imp.importer:
            graph.setdefault(imp.importer, set()).add(imp.target)
    return [" -> ".join(c + c[:1]) for c in _cycles(graph)]


def runtime_floor_problems(root: Path, floor: str = "runtime") -> list[str]:
    """Imports, anywhere in ``<pkg>.<floor>``, of a module of the package outside ``<pkg>.<floor>``
    (the package's own ``__init__`` included: it imports everything)."""
    base = f"{root.name}.{floor}"
    return [f"{imp.importer}:{imp.line} imports {imp.target} (the {floor}/ floor imports nothing above it)"
            for imp in collect_imports(root)
            if (imp.importer == base or imp.importer.startswith(base + "."))
            and not (imp.target == base or imp.target.startswith(base + "."))]


# The layers, low to high; packages on one line are one layer and may import each other. A module
# outside every package named here (the package's own ``__init__``) sits above them all.
LAYERS = [
    ("runtime",),
    ("costmodel", "models"),
    ("communication", "kernels"),
    ("memory",),
    ("parallelism", "sparsity"),
    ("resilience",),
    ("analysis",),
    ("course",),
    ("__main__",),
]


def _layer(module: str, pkg: str, layers) -> int:
    """The layer index of ``module`` (by its first component under the package); above all if none."""
    first = module.split(".")[1] if module.count(".") else ""
    return next((i for i, names in enumerate(layers) if first in names), len(layers))


def layer_problems(root: Path, layers=LAYERS) -> list[str]:
    """Every import (top level or in a function) from a module to one of a higher layer."""
    pkg, names = root.name, [" ".join(names) for names in layers]
    out = []
    for imp in collect_imports(root):
        lo, hi = _layer(imp.importer, pkg, layers), _layer(imp.target, pkg, layers)
        if hi > lo:
            up = names[hi] if hi < len(layers) else f"{pkg}/__init__"
            out.append(f"{imp.importer}:{imp.line} imports {imp.target}: {names[lo]} may not import "
                       f"{up}, which sits above it")
    return out


# --- the real package -------------------------------------------------------------------------------


def test_the_package_is_found():
    mods = module_names(ROOT)
    assert "minitorch_dist.runtime.comm" in mods and "minitorch_dist" in mods
    assert any(i.target == "minitorch_dist.runtime.comm" for i in collect_imports(ROOT))


def test_no_import_cycles():
    assert import_cycle_problems(ROOT) == []


def test_no_import_cycles_hidden_in_functions():
    assert import_cycle_problems(ROOT, top_level_only=False) == []


def test_no_private_imports_between_modules():
    assert private_import_problems(ROOT) == []


def test_runtime_imports_nothing_above_it():
    assert runtime_floor_problems(ROOT) == []


def test_every_import_runs_down_the_layers():
    assert layer_problems(ROOT) == []


# Modules past ~400 lines are usually two ideas (DESIGN.md). Each one allowed to be longer says why.
MAX_LINES = 400
LONG_MODULES = {
    "minitorch_dist/parallelism/parameter_server.py":
        "one protocol, its server, worker and runner; the observer that stamps its times (moved out of "
        "the technique's own lines) and puts every rank on one clock sits beside them",
    "minitorch_dist/analysis/planner.py":
        "one search: the candidates, each one's memory and time through one cache of formulas, the "
        "ranking; the presets and the CLI live apart already",
    "minitorch_dist/analysis/calibrate.py":
        "every rate of a machine profile is measured here, each by one short function; op timing and "
        "the workload recorder live apart already",
    "minitorch_dist/memory/zero/sharded_optimizer.py":
        "one torch.optim.Optimizer: stages 1 and 2 differ only in when the gradient is reduce-scattered, "
        "and its state_dict must serve both",
    "minitorch_dist/parallelism/three_d.py":
        "chapter 12's recipe: Stage3D, Model3D and train_3d compose TP, PP and ZeRO-1 and are read together",
    "minitorch_dist/kernels/flash_attention.py":
        "the forward and the two backward Triton kernels of one algorithm, with their launchers",
}


def long_module_problems(root: Path, allowed: dict[str, str], max_lines: int = MAX_LINES) -> list[str]:
    """Modules over ``max_lines`` lines that the allow-list does not explain, and allow-list entries
    that are no longer needed (the module shrank or went away)."""
    base = root.parent
    long = {str(p.relative_to(base)): len(p.read_text(encoding="utf-8").splitlines())
            for p in sorted(root.rglob("*.py"))}
    out = [f"{m}: {n} lines (over {max_lines}): split it, or say why in LONG_MODULES"
           for m, n in long.items() if n > max_lines and m not in allowed]
    out += [f"{m} is in LONG_MODULES but has {long.get(m, 0)} lines: remove the entry"
            for m in allowed if long.get(m, 0) <= max_lines]
    return out


def test_long_modules_say_why():
    assert long_module_problems(ROOT, LONG_MODULES) == []


def test_long_module_rule_catches_a_long_module_and_a_stale_entry(tmp_path):
    root = _fake(tmp_path, {"a.py": "x = 1\n" * 5, "b.py": "y = 2\n"})
    assert long_module_problems(root, {"fakepkg/b.py": "why"}, max_lines=3) == [
        "fakepkg/a.py: 5 lines (over 3): split it, or say why in LONG_MODULES",
        "fakepkg/b.py is in LONG_MODULES but has 1 lines: remove the entry"]


def unlayered(root: Path, layers=LAYERS) -> list[str]:
    """Subpackages and top-level modules of ``root`` that no layer names (each must have a place)."""
    named = {n for names in layers for n in names}
    found = {p.name for p in root.iterdir() if (p / "__init__.py").exists() or p.suffix == ".py"}
    return sorted(found - {"__init__.py"} - {n + ".py" for n in named} - named)


def test_every_package_has_a_layer():
    assert unlayered(ROOT) == []


def test_layer_rule_catches_a_package_with_no_layer(tmp_path):
    root = _fake(tmp_path, {"runtime/comm.py": "x = 1\n", "plugins/extra.py": "y = 2\n", "cli.py": "z = 3\n",
                            "__main__.py": "w = 4\n", "data/notes.txt": "not a package\n"})
    (root / "data" / "__init__.py").unlink()  # a plain folder holds no code to place
    assert unlayered(root) == ["cli.py", "plugins"]


# A process group is what every parallel wrapper takes, and its type is the API: annotated
# (``dist.ProcessGroup | None``: None is the default group), mypy checks what callers pass.
def _is_group(name: str) -> bool:
    return name == "group" or name.endswith("_group")


def _triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A ``@triton.jit`` kernel: its arguments are launch values (``rows_per_group``), no process group."""
    return any(ast.unparse(d).split("(")[0].endswith("jit") for d in fn.decorator_list)


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.arg]:
    a = fn.args
    yield from (*a.posonlyargs, *a.args, *a.kwonlyargs)
    yield from (x for x in (a.vararg, a.kwarg) if x is not None)


def group_annotation_problems(root: Path) -> list[str]:
    """Function parameters named ``group`` or ``*_group`` without an annotation (lambdas cannot have
    one; Triton kernels are skipped)."""
    out = []
    for mod, path in module_names(root).items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _triton_kernel(fn):
                out += [f"{mod}:{p.lineno} {fn.name}({p.arg}) is not annotated"
                        for p in _parameters(fn) if _is_group(p.arg) and p.annotation is None]
    return out


def test_every_group_parameter_is_annotated():
    assert group_annotation_problems(ROOT) == []


# --- each rule catches its violation on a fake package ----------------------------------------------


def _fake(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "fakepkg"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    return root


def test_cycle_rule_catches_a_cycle(tmp_path):
    root = _fake(tmp_path, {
        "a.py": "from . import b\n",
        "b.py": "from .sub.c import thing\n",
        "sub/c.py": "import fakepkg.a\nthing = 1\n",
        "d.py": "def f():\n    from . import e\n",  # inside a function: not a cycle
        "e.py": "from .d import f\n",
        "sub/__init__.py": "from .c import thing\n",  # a package importing its own module: fine
    })
    assert import_cycle_problems(root) == ["fakepkg.a -> fakepkg.b -> fakepkg.sub.c -> fakepkg.a"]
    assert import_cycle_problems(root, top_level_only=False) == [
        "fakepkg.a -> fakepkg.b -> fakepkg.sub.c -> fakepkg.a", "fakepkg.d -> fakepkg.e -> fakepkg.d"]


def test_cycle_rule_catches_a_module_importing_its_package_init(tmp_path):
    root = _fake(tmp_path, {"__init__.py": "from .m import x\nY = 2\n", "m.py": "from . import Y\nx = Y\n"})
    assert import_cycle_problems(root) == ["fakepkg -> fakepkg.m -> fakepkg"]


def test_private_rule_catches_private_names_and_modules(tmp_path):
    root = _fake(tmp_path, {
        "a.py": "_helper = 1\n__version__ = '1'\n",
        "b.py": "from .a import __version__\ndef f():\n    from .a import _helper\n",
        "k/_impl.py": "x = 1\n",
        "k/use.py": "from ._impl import x\n",  # its own package: fine
        "c.py": "from .k._impl import x\n",
    })
    assert private_import_problems(root) == [
        "fakepkg.b:3 imports private name '_helper' from fakepkg.a",
        "fakepkg.c:1 imports private module fakepkg.k._impl from outside fakepkg.k",
    ]


def test_layer_rule_catches_an_upward_import_in_a_function(tmp_path):
    root = _fake(tmp_path, {
        "runtime/comm.py": "x = 1\n",
        "models/gpt.py": "from ..runtime import comm\n",  # down: fine
        "costmodel/cost.py": "def f():\n    from ..models import gpt\n",  # same layer: fine
        "memory/zero.py": "def f():\n    from ..parallelism import tp\n",
        "parallelism/tp.py": "from ..memory import zero\n",
    })
    assert layer_problems(root) == [
        "fakepkg.memory.zero:2 imports fakepkg.parallelism.tp: memory may not import parallelism sparsity, "
        "which sits above it"]


def test_floor_rule_catches_runtime_importing_above(tmp_path):
    root = _fake(tmp_path, {
        "runtime/comm.py": "from . import env\nimport torch\n",
        "runtime/env.py": "def f():\n    from ..analysis.cost import g\n",
        "analysis/cost.py": "from ..runtime import comm\ndef g():\n    pass\n",
    })
    assert runtime_floor_problems(root) == [
        "fakepkg.runtime.env:2 imports fakepkg.analysis.cost (the runtime/ floor imports nothing above it)"]


def test_group_rule_catches_an_unannotated_group(tmp_path):
    root = _fake(tmp_path, {
        "a.py": ("import torch.distributed as dist\n"
                 "def f(x, group: dist.ProcessGroup | None = None, tp_group: 'dist.ProcessGroup' = None):\n"
                 "    pass\n"),  # annotated: fine
        "b.py": ("class Layer:\n"
                 "    def __init__(self, dp_group, *, group=None, grouping=1):\n"  # grouping: not a group
                 "        self.f = lambda group: group\n"),  # a lambda cannot be annotated: fine
        "c.py": "def g(*, replicate_group=None):\n    pass\n",
        "k.py": "import triton\n@triton.jit\ndef kernel(x_ptr, rows_per_group):\n    pass\n",  # kernel: fine
    })
    assert group_annotation_problems(root) == [
        "fakepkg.b:2 __init__(dp_group) is not annotated",
        "fakepkg.b:2 __init__(group) is not annotated",
        "fakepkg.c:1 g(replicate_group) is not annotated",
    ]
