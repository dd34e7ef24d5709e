"""The house reads one way: the decision core imports nothing of the runtime or the commands, its layers
import only downwards, and no module of ``src/moe_fsm`` takes part in an import circle.

Every import statement counts, wherever it stands: module level, inside a function (a lazy import) or
under ``if TYPE_CHECKING:``. docs/architecture.md draws the same picture.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# The decision core, bottom to top: each layer imports only from its own layer and the ones below.
CORE_LAYERS = (
    ("moe_fsm.errors",),
    ("moe_fsm.inputs", "moe_fsm.trace"),
    ("moe_fsm.backends.requirements", "moe_fsm.backends.specs", "moe_fsm.backends.verdict",
     "moe_fsm.backends.pf_choice", "moe_fsm.backends.build_plan", "moe_fsm.backends.grouped_mm_eligibility",
     "moe_fsm.backends.extensions"),
    ("moe_fsm.fsm.policy", "moe_fsm.fsm.activation_order", "moe_fsm.fsm.steps", "moe_fsm.fsm.candidate_steps",
     "moe_fsm.fsm.runner_steps", "moe_fsm.fsm.measured_steps"),
    ("moe_fsm.profiles",),
    ("moe_fsm.backends.registry", "moe_fsm.backends"),
    ("moe_fsm.fsm.machine", "moe_fsm.fsm.decide", "moe_fsm.fsm"),
    ("moe_fsm.decision",),
    ("moe_fsm.plan", "moe_fsm.diff", "moe_fsm.golden"),
)
# The wings around it: what builds and runs kernels, and the commands.
RUNTIME = ("moe_fsm.runtime", "moe_fsm.modular", "moe_fsm.experts", "moe_fsm.kernels", "moe_fsm.quantize",
           "moe_fsm.prepare_finalize", "moe_fsm.distributed", "moe_fsm.engine", "moe_fsm.integrations",
           "moe_fsm.launch_trampoline")
FACE = ("moe_fsm.cli", "moe_fsm.__main__")


def _modules() -> dict[str, Path]:
    modules = {}
    for path in (SRC / "moe_fsm").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module an imported name lives in (``moe_fsm.inputs.env.EnvSnapshot`` -> ``moe_fsm.inputs.env``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> dict[str, int]:
    """The moe_fsm modules ``module`` imports, each with the line of its first import statement."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = _owner(name) if name.startswith("moe_fsm") else None
            # a package's own __init__ is not an import of the package by its modules
            if target and target != module and not module.startswith(target + "."):
                found.setdefault(target, node.lineno)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _layer(module: str) -> int | None:
    """The core layer of a module (the longest matching prefix decides), None outside the core."""
    best = None
    for level, prefixes in enumerate(CORE_LAYERS):
        for prefix in prefixes:
            if _within(module, (prefix,)) and (best is None or len(prefix) > len(best[1])):
                best = (level, prefix)
    return None if best is None else best[0]


def test_every_module_is_placed_in_the_core_or_a_wing():
    unplaced = [m for m in MODULES if m != "moe_fsm" and _layer(m) is None and not _within(m, RUNTIME + FACE)]
    assert not unplaced, f"place these in CORE_LAYERS, RUNTIME or FACE (and in docs/architecture.md): {unplaced}"


def test_the_core_imports_nothing_of_the_runtime_or_the_commands():
    outward = [f"{m} -> {t} (line {line})" for m in MODULES if _layer(m) is not None
               for t, line in GRAPH[m].items() if _layer(t) is None]
    assert not outward, "the decision core imports outside itself:\n" + "\n".join(outward)


def test_the_core_layers_import_only_downwards():
    upward = [f"{m} (layer {_layer(m)}) -> {t} (layer {_layer(t)}, line {line})" for m in MODULES
              if _layer(m) is not None for t, line in GRAPH[m].items()
              if _layer(t) is not None and _layer(t) > _layer(m)]
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


def test_no_import_circles():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in GRAPH[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(MODULES):
        if module not in index:
            visit(module)
    assert not circles, "import circles:\n" + "\n".join(", ".join(c) for c in circles)


def _loaded_after(statement: str) -> set[str]:
    """The modules a fresh interpreter has loaded after ``statement`` (a subprocess: this one has loaded everything)."""
    import json
    import subprocess
    import sys

    probe = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_the_package_face_loads_nothing_of_the_runtime_until_asked():
    """Every module imports ``moe_fsm/__init__.py`` first: it must not pull the runtime (torch included) into the
    core. Its names are loaded on first use."""
    runtime = {"moe_fsm.engine", "moe_fsm.runtime", "moe_fsm.modular", "moe_fsm.kernels", "torch"}
    for statement in ("import moe_fsm", "import moe_fsm.trace.document", "from moe_fsm import select, __version__",
                      "import moe_fsm.decision"):
        assert not runtime & _loaded_after(statement), statement
    assert {"moe_fsm.runtime", "moe_fsm.engine.engine"} <= _loaded_after("from moe_fsm import build, Engine")


def test_the_package_face_names_every_public_name_and_refuses_others():
    import importlib

    import moe_fsm

    for name in moe_fsm.__all__:
        assert getattr(moe_fsm, name) is not None, name
    assert set(moe_fsm.__all__) <= set(dir(moe_fsm))
    from importlib import metadata

    assert moe_fsm.__version__ == metadata.version("moe-fsm")
    try:
        moe_fsm.no_such_name
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
    assert importlib.import_module("moe_fsm").select is moe_fsm.select


def test_every_command_returns_its_exit_status_by_name():
    """Exit statuses come from ``cli/exit_codes`` (one table, printed by ``moe-fsm --help``), not literals."""
    literal = []
    for path in sorted((SRC / "moe_fsm" / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Return) and node.value is not None:
                values, outcomes = [node.value], []
                while values:  # the outcomes of nested conditional expressions
                    value = values.pop()
                    values += [value.body, value.orelse] if isinstance(value, ast.IfExp) else []
                    outcomes += [] if isinstance(value, ast.IfExp) else [value]
                literal += [f"{path.name}:{node.lineno}" for v in outcomes
                            if isinstance(v, ast.Constant) and isinstance(v.value, int) and not isinstance(v.value, bool)]
    assert not literal, "return exit statuses by their cli/exit_codes name: " + ", ".join(literal)


def test_the_maintainer_tools_import_in_no_circle():
    """``tools/`` runs as scripts with ``tools/`` on ``sys.path``: its modules import each other by top-level name."""
    tools = SRC.parent / "tools"
    names = {p.stem: p for p in tools.glob("*.py")} | {p.parent.name: p for p in tools.glob("*/__init__.py")}
    for package in (p.parent for p in tools.glob("*/__init__.py")):
        names |= {f"{package.name}.{p.stem}": p for p in package.glob("*.py") if p.stem != "__init__"}

    def imports(path: Path) -> set[str]:
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                       if isinstance(node, ast.ImportFrom) and not node.level else [])
            found |= {t for t in targets if t in names}
        return found

    graph = {name: imports(path) - {name} for name, path in names.items()}
    # a module naming its own package (``from parity_families.fakes import ...`` inside parity_families) finds the
    # package initialized already: not an edge back to it
    graph = {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in graph.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(t == goal or (t not in seen and reaches(t, goal, seen | {t})) for t in graph[start])

    circles = sorted(name for name in graph if reaches(name, name, {name}))
    assert not circles, f"tools/ modules in an import circle: {circles}"
