"""Imports go one way: no cycle among qlbench's modules (function-local imports included), no module imports one of
a higher layer (LAYERS, as docs/design.md draws them), library modules never import the command-line layer
(qlbench.cli, qlbench.commands), and only qlbench.ray_executor imports Ray, inside its functions (Ray is an optional
extra: `import qlbench` and the local executor never need it)."""

from __future__ import annotations

import ast
from pathlib import Path

import qlbench

ROOT = Path(qlbench.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """qlbench module -> the qlbench modules it imports anywhere in its text (top level or inside functions).
    `from a.b import c` counts as importing a.b.c when that is a module, else a.b."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                for a in node.names:
                    deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


# Bottom to top. A module may import modules of its own layer (no cycle) or of a lower one; a package's modules
# (qlbench.adapters.lora) sit in the package's layer.
LAYERS = [
    [
        "qlbench",
        "qlbench.records",
        "qlbench.experiments",
        "qlbench.metrics",
        "qlbench.seeding",
        "qlbench.records.store",
        "qlbench.records.record",
        "qlbench.records.schema",
        "qlbench.soap",
        "qlbench.stacked",
        "qlbench.gradients",
        "qlbench.metrics.continual",
    ],
    ["qlbench.text", "qlbench.inputs", "qlbench.progress", "qlbench.zoo", "qlbench.parametric"],
    [
        "qlbench.backbones",
        "qlbench.instructions",
        "qlbench.records.results",
        "qlbench.records.per_seed",
        "qlbench.suites",
        "qlbench.instances",
    ],
    ["qlbench.adapters"],
    ["qlbench.engine"],
    [
        "qlbench.experiments.planning",
        "qlbench.settings",
        "qlbench.experiments.runner",
        "qlbench.protocols",
        "qlbench.experiments.experiment",
        "qlbench.experiments.adapted",
        "qlbench.experiments.suite_tasks",
        "qlbench.cost",
        "qlbench.experiments.pareto_stack",
        "qlbench.experiments.grid",
    ],
    [
        "qlbench.metrics.stats",
        "qlbench.metrics.board",
        "qlbench.metrics.items",
        "qlbench.metrics.validity",
        "qlbench.compare",
        "qlbench.theory",
        "qlbench.verify",
        "qlbench.bench",
        "qlbench.ray_executor",
        "qlbench.experiments.multitask",
        "qlbench.metrics.suite_stats",
        "qlbench.hf",
        "qlbench.experiments.real",
        "qlbench.experiments.real_lm",
    ],
    ["qlbench.diagnostics", "qlbench.experiments.ablation", "qlbench.experiments.pareto"],
    ["qlbench.report"],
    ["qlbench.commands"],
    ["qlbench.cli"],
]


# packages that are folders of modules of several layers, each module placed on its own; their __init__ imports nothing
FOLDERS = {"qlbench", "qlbench.records", "qlbench.experiments", "qlbench.metrics"}


def layer_of(module: str) -> int:
    """The index in LAYERS of a module or of the package it belongs to; KeyError for one LAYERS does not place."""
    for i, layer in enumerate(LAYERS):  # a module named on its own first (qlbench.experiments.runner)
        if module in layer:
            return i
    for i, layer in enumerate(LAYERS):  # then the package it belongs to (qlbench.engine.loop)
        if any(module.startswith(m + ".") for m in layer if m not in FOLDERS):
            return i
    raise KeyError(module)


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """module -> the modules of a higher layer it imports."""
    return {m: sorted(d for d in deps if layer_of(d) > layer_of(m)) for m, deps in graph.items()}


def test_every_module_has_a_layer():
    unplaced = []
    for m in import_graph():
        try:
            layer_of(m)
        except KeyError:
            unplaced.append(m)
    assert not unplaced, f"add these modules to LAYERS (and to docs/design.md): {unplaced}"


def test_no_module_imports_a_higher_layer():
    assert {m: up for m, up in upward_imports(import_graph()).items() if up} == {}


def test_the_layer_check_finds_a_planted_upward_import():
    graph = import_graph()
    graph["qlbench.zoo"] = graph["qlbench.zoo"] | {"qlbench.engine"}
    assert upward_imports(graph)["qlbench.zoo"] == ["qlbench.engine"]


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_graph_sees_function_local_imports():
    graph = import_graph()
    assert "qlbench.commands.run" in graph["qlbench.cli"]
    assert "qlbench.report" in graph["qlbench.commands.run"]  # imported inside run()


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_library_modules_do_not_import_the_command_line_layer():
    cli_layer = {m for m in import_graph() if m == "qlbench.cli" or m.startswith("qlbench.commands")}
    offenders = {
        m: sorted(deps & cli_layer) for m, deps in import_graph().items() if m not in cli_layer and deps & cli_layer
    }
    assert not offenders


def ray_imports() -> dict[str, set[str]]:
    """qlbench module -> where it imports ray: 'top' (module level, including under if/try) or 'function'."""
    found = {}
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        functions = (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
        inside = {id(node) for f in functions for node in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            if any(n == "ray" or n.startswith("ray.") for n in names):
                found.setdefault(module_name(path), set()).add("function" if id(node) in inside else "top")
    return found


def test_only_the_ray_executor_imports_ray_and_only_inside_functions():
    found = ray_imports()
    assert found == {"qlbench.ray_executor": {"function"}}, found
    assert "qlbench.ray_executor" in import_graph()["qlbench.commands.run"]  # the layer above it


# Training steps: the library's one training loop is the engine's (engine.fit and make_step). The benchmark's plain
# loop is the exception by design: it is the PyTorch loop a user would write, which the engine is measured against.
BACKWARD_ALLOWED = {
    "qlbench.bench.models": "the plain PyTorch loop `qlbench bench` compares the engine with",
    "qlbench.adapters.member": "the probe that decides whether vmap can run a method's backward (no update)",
}


def backward_callers(sources: dict[str, str]) -> list[str]:
    """The modules (name -> source text) that call `.backward(...)`, `torch.autograd.backward` or
    `torch.autograd.grad`, outside the engine package and BACKWARD_ALLOWED."""
    found = []
    for name, text in sources.items():
        if name == "qlbench.engine" or name.startswith("qlbench.engine.") or name in BACKWARD_ALLOWED:
            continue
        calls = [n.func for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Call)]
        if any(isinstance(f, ast.Attribute) and f.attr in ("backward", "grad") for f in calls):
            found.append(name)
    return sorted(found)


def test_only_the_engine_runs_a_backward_pass():
    sources = {module_name(p): p.read_text() for p in ROOT.rglob("*.py")}
    assert backward_callers(sources) == []


def test_the_backward_check_finds_a_planted_training_loop():
    planted = "def train(model, x):\n    loss = model(x).sum()\n    loss.backward()\n"
    grad = "import torch\ndef g(y, x):\n    return torch.autograd.grad(y, x)\n"
    sources = {
        "qlbench.experiments.multitask": planted,
        "qlbench.experiments.real": grad,
        "qlbench.engine.loop": planted,
    }
    assert backward_callers(sources) == ["qlbench.experiments.multitask", "qlbench.experiments.real"]


# Functions take at most MAX_PARAMETERS parameters (`self` and `cls` not counted; an autograd.Function's `ctx` not
# counted either: it is the function's own state, as `self` is); settings travel whole, in the settings objects
# (qlbench.settings) or a dataclass of their own. Dataclass constructors are generated, not written, and not seen here.
MAX_PARAMETERS = 8


def wide_functions(sources: dict[str, str]) -> list[str]:
    """'module.function (n)' for every function of the sources (module -> text) with more than MAX_PARAMETERS."""
    found = []
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
                n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
                n -= bool(names) and names[0] in ("self", "cls", "ctx")
                if n > MAX_PARAMETERS:
                    found.append(f"{module}.{node.name} ({n})")
    return found


def test_no_function_takes_more_than_eight_parameters():
    sources = {module_name(p): p.read_text() for p in ROOT.rglob("*.py")}
    assert wide_functions(sources) == []


def test_the_parameter_count_finds_a_planted_wide_function():
    planted = "def f(a, b, c, d, e, f, g, h, i):\n    pass\n"  # nine: found
    planted += "class C:\n    def m(self, a, b, c, d, e, f, g, h):\n        pass\n"  # eight and self: fine
    assert wide_functions({"m": planted}) == ["m.f (9)"]


MAX_LINES = 500


def test_no_module_is_over_five_hundred_lines():
    long = {module_name(p): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_library_code_names_no_device_a_figure_was_measured_on():
    """Measured figures and the devices they came from live in docs/speed.md (one table per device), not in code:
    a comment says why, and links there."""
    named = [module_name(p) for p in ROOT.rglob("*.py") if any(d in p.read_text() for d in ("H200", "H100", "A100"))]
    assert named == []


def test_records_is_storage_that_imports_no_experiment():
    """records/ stores and reads records; what trains them (the runner, the workloads) lives in experiments/, and the
    arrow points one way (docs/design.md)."""
    graph = import_graph()
    storage = {m: sorted(d for d in deps if d.startswith("qlbench.experiments")) for m, deps in graph.items()}
    assert {m: d for m, d in storage.items() if m.startswith("qlbench.records") and d} == {}
    assert "qlbench.experiments.runner" in graph and not any(m.endswith(".runner") for m in graph if "records" in m)


def test_settings_import_nothing_that_plans():
    """The settings objects and their checks sit below every plan: settings.py imports no module of experiments/."""
    assert sorted(d for d in import_graph()["qlbench.settings"] if d.startswith("qlbench.experiments")) == []
