"""Importing the package does nothing but define it.

- No module changes another module's globals while it is imported (a runner or rule registered
  into another module's list, a slot set there): every module of ``titan_dualpipe`` is imported
  in a fresh interpreter, and around each module's own execution the globals of every module
  already loaded are compared (names bound, and what their dicts, lists, sets, objects and
  classes hold).
- The modules' imports (those inside functions too) form no circle.

The torchtitan adapter (``titan_dualpipe.titan``) patches torchtitan when it is imported, as
torchtitan's ``custom_import`` asks of it; what it patches is torchtitan's, not ours.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "titan_dualpipe"

# Run in a fresh interpreter: imports every module of the package, each module's own execution
# wrapped by a loader that compares the already-loaded modules' globals before and after it.
_PROBE = r'''
import importlib, importlib.abc, importlib.util, json, pkgutil, sys, types

PREFIX = "titan_dualpipe"
running = []  # modules whose code is executing (their globals are still being built)
changes = {}  # "module.name" -> the module whose import changed it


def fingerprint(value):
    """What a global holds, by identity, one level down (a container's items, an object's or
    class's attributes)."""
    if isinstance(value, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
        return None
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(k), id(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(id(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(id(v) for v in value)))
    if isinstance(value, type):
        return ("class", tuple(sorted((k, id(v)) for k, v in vars(value).items()
                                      if not (k.startswith("__") and k.endswith("__")) and k != "_abc_impl")))
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict):
        return ("object", tuple(sorted((k, id(v)) for k, v in attrs.items())))
    return None


def snapshot():
    shot = {}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != PREFIX or name in running or module is None:
            continue
        for key, value in list(vars(module).items()):
            if isinstance(value, types.ModuleType) or (key.startswith("__") and key.endswith("__")):
                continue
            shot[f"{name}.{key}"] = (id(value), fingerprint(value))
    return shot


class Watching(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        before = snapshot()
        running.append(module.__name__)
        try:
            self.loader.exec_module(module)
        finally:
            running.pop()
        after = snapshot()
        for key, seen in before.items():
            if after.get(key) != seen:
                changes.setdefault(key, module.__name__)


class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] != PREFIX:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = Watching(spec.loader)
                return spec
        return None


sys.meta_path.insert(0, Finder())
import titan_dualpipe

names, skipped = [], {}
for info in pkgutil.walk_packages(titan_dualpipe.__path__, PREFIX + ".", onerror=lambda name: None):
    if info.name.rsplit(".", 1)[-1] == "__main__":
        continue
    names.append(info.name)
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as err:  # a module for the other torchtitan release
        skipped[name] = str(err)
print(json.dumps({"imported": [n for n in names if n not in skipped], "skipped": skipped, "changes": changes}))
'''


def test_importing_changes_no_other_modules_globals() -> None:
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["imported"]) > 50, result
    assert not result["changes"], "\n".join(f"{key} changed while importing {who}"
                                            for key, who in sorted(result["changes"].items()))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import in a module, those inside functions (run later, still a dependency) included;
    not those under ``if TYPE_CHECKING:`` (for annotations only)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.append(child)
        elif isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
            found += [i for stmt in child.orelse for i in _imports(ast.Module(body=[stmt], type_ignores=[]))]
        else:
            found += _imports(child)
    return found


def import_graph() -> dict[str, set[str]]:
    """``module -> modules of the package it imports`` (the module a name comes from:
    ``from .a import b`` is ``a``, or ``a.b`` when that is a module)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in paths}
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                edges.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in paths else source)
        graph[name] = {e for e in edges if e in paths and e != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_import_graph_sees_imports() -> None:
    graph = import_graph()
    assert "titan_dualpipe.overlap.schedules" in graph["titan_dualpipe"]
    assert "titan_dualpipe.titan.active" in graph["titan_dualpipe.titan.expert_overlap"]
    assert "titan_dualpipe.runtime.executor" not in graph["titan_dualpipe.runtime.pairs"]  # TYPE_CHECKING only
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_circle() -> None:
    cycle = _cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_old_public_names_warn_and_still_work() -> None:
    """Names users called before they moved or were renamed: a DeprecationWarning naming the new one,
    and the same object or result."""
    import importlib
    import warnings

    import torch

    from titan_dualpipe import cut, weights
    from titan_dualpipe.overlap import MoEArgs, MoETransformer

    moved = [("titan_dualpipe.runtime.deferred_weights", "register_expert_class", weights.register_expert_class),
             ("titan_dualpipe.runtime.deferred_weights", "uninstall", weights.uninstall),
             ("titan_dualpipe.runtime.split_backward", "register_whole_backward_rule",
              weights.register_whole_backward_rule)]
    for module, name, new in moved:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert getattr(importlib.import_module(module), name) is new
        assert [w.category for w in caught] == [DeprecationWarning] and f"titan_dualpipe.weights.{name}" in str(caught[0].message)
    from titan_dualpipe.overlap import split_parts

    torch.manual_seed(0)
    model = MoETransformer(MoEArgs(n_layers=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = split_parts(model, 2)
    assert [w.category for w in caught] == [DeprecationWarning] and "cut_layers" in str(caught[0].message)
    assert [list(p.state_dict()) for p in old] == [list(p.state_dict()) for p in cut.cut_layers(model, 2)]


def test_renamed_schedule_keywords_warn_and_still_work() -> None:
    """``weights_in_flight=`` reaches the constructor as ``weight_gemms_in_flight=``, with a DeprecationWarning."""
    import warnings

    from titan_dualpipe.runtime.schedules import _renamed_keywords

    class Schedule:
        @_renamed_keywords
        def __init__(self, stages, *, weight_gemms_in_flight: bool = True) -> None:
            self.in_flight = weight_gemms_in_flight

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert Schedule([], weights_in_flight=False).in_flight is False
    assert [w.category for w in caught] == [DeprecationWarning] and "weight_gemms_in_flight" in str(caught[0].message)
    assert Schedule([]).in_flight is True


def test_the_sub_batch_protocol_under_its_old_names_warns_and_still_works() -> None:
    """``OverlappedHalves`` and a module class defining ``overlapped_halves_forward/backward`` (the
    protocol's names before two-batch pieces were called sub-batches): a DeprecationWarning, and
    the class's methods still run."""
    import warnings

    from torch import nn

    from titan_dualpipe import overlap
    from titan_dualpipe.overlap.protocol import OverlappedSubBatches, sub_batches_implementation

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert overlap.OverlappedHalves is OverlappedSubBatches
    assert [w.category for w in caught] == [DeprecationWarning]

    class Old(nn.Module):
        @classmethod
        def overlapped_halves_forward(cls, module, sub_batches):
            return ["forward", len(sub_batches)]

        @classmethod
        def overlapped_halves_backward(cls, module, sub_batches):
            return None

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        provider = sub_batches_implementation(Old())
    assert [w.category for w in caught] == [DeprecationWarning] and "overlapped_sub_batches_forward" in str(caught[0].message)
    assert provider.overlapped_sub_batches_forward(Old(), [1, 2]) == ["forward", 2]
    assert sub_batches_implementation(nn.Linear(1, 1)) is None
