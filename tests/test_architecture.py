"""The architecture, checked: modules and packages in layers, library below, programs above.

Layers (lowest first; docs/architecture.md). A package imports only from
packages of lower layers (never from its own layer's other packages, never upwards); the
library (every layer below ``config``) imports nothing of the programs; ``syncer`` and
``learner`` are siblings that do not import each other. Module level: no import cycle,
nothing imports the CLI, only the CLI parses flags, no module over 600 lines.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "diloco"

LAYERS: list[tuple[str, ...]] = [
    ("algorithm", "runtime"),  # pure math; ground-floor helpers (units, files, processes)
    ("wire",),  # the protocol: messages, its settings, authentication
    ("recipes", "chaos", "data"),  # models and data; failure schedules; a data position
    ("syncer", "learner"),  # the two libraries, siblings
    ("bench", "wan", "integrations"),  # bench settings; wide-area links; training callbacks
    ("report",),  # reading what runs leave
    ("sim", "dashboard", "plan"),  # the simulator and planner; showing runs
    ("config",),  # the programs' configurations
    ("launch",),  # the programs we start (syncer, learner, launcher, evaluator, ...)
    ("baselines",),  # data-parallel and torchft programs (they register their modes)
    ("cli",),  # the edge
]
PROGRAMS = {"config", "launch", "baselines", "cli"}
LAYER = {package: i for i, layer in enumerate(LAYERS) for package in layer}


# ------------------------------------------------------------------------- import graph
def import_graph() -> dict[str, set[str]]:
    """Module -> the diloco modules it imports (anywhere in its body, also inside functions)."""
    modules = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                if t.startswith("diloco"):
                    r = resolve(t)
                    if r and r != mod:
                        graph[mod].add(r)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_check_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_nothing_below_the_cli_imports_it():
    graph = import_graph()
    below = {m: d for m, d in graph.items() if not m.startswith("diloco.cli")}
    offenders = {m: sorted(t for t in d if t.startswith("diloco.cli")) for m, d in below.items()}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_argparse_only_at_the_edge():
    """Only the CLI room parses flags; runtime.schema builds them, cadence gives a flag type."""
    allowed = {SRC / "runtime" / "schema.py", SRC / "runtime" / "cadence.py"}
    users = [
        p.relative_to(SRC).as_posix()
        for p in SRC.rglob("*.py")
        if "cli" not in p.relative_to(SRC).parts[:1]
        and p not in allowed
        and re.search(r"^\s*import argparse", p.read_text(), re.M)
    ]
    assert users == []


def test_no_module_over_600_lines():
    long = {
        p.relative_to(SRC).as_posix(): n
        for p in SRC.rglob("*.py")
        if not p.name.startswith("diloco_pb2") and (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}


PARSE_ONLY = """
import sys
from diloco.cli import main
for argv in ARGVS:
    try:
        main(argv)
    except SystemExit:
        pass
print(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "numpy"}))
"""


def test_the_cli_parses_and_refuses_flags_without_importing_torch():
    """``diloco --help`` and a flag refused while parsing or checking the configuration
    (before anything runs) load neither torch nor numpy: a mistyped flag is answered in a
    fraction of a second, not after the seconds torch takes to import."""
    argvs = [
        ["--help"],
        ["syncer", "--nonsense"],
        ["syncer", "--bind", "nonsense"],
        ["syncer", "--model", "my model"],
        ["syncer", "--max-learners", "2000"],
        ["run", "--learners", "0"],
        ["run", "--mode", "dp", "--bf16"],
        ["learner", "--help"],
        ["plan", "--nonsense"],
        ["learner-token", "--nonsense"],
        ["export", "--nonsense"],
    ]
    done = subprocess.run(
        [sys.executable, "-c", f"ARGVS = {argvs!r}\n{PARSE_ONLY}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stderr


def package_of(module: str) -> str:
    """``diloco.syncer.state`` -> ``syncer`` (a top-level module is its own package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_imports(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the module imports behind it."""
    found: dict[tuple[str, str], list[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = package_of(module), package_of(target)
            if a != b and "diloco" not in (a, b):
                found.setdefault((a, b), []).append(f"{module} -> {target}")
    return found


def upward(imports: dict[tuple[str, str], list[str]]) -> dict[tuple[str, str], list[str]]:
    """The package imports that break the layers (same layer, or upwards)."""
    return {
        (a, b): how
        for (a, b), how in imports.items()
        if LAYER.get(b, -1) >= LAYER.get(a, len(LAYERS))
    }


def test_every_package_has_a_layer():
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"}
    assert packages - set(LAYER) == set()


def test_no_package_imports_its_layer_or_above():
    assert upward(package_imports(import_graph())) == {}


def test_the_library_imports_nothing_of_the_programs():
    imports = package_imports(import_graph())
    assert {k: v for k, v in imports.items() if k[0] not in PROGRAMS and k[1] in PROGRAMS} == {}


def test_the_syncer_and_the_learner_do_not_import_each_other():
    imports = package_imports(import_graph())
    assert ("syncer", "learner") not in imports and ("learner", "syncer") not in imports


def test_the_layer_check_can_fail():
    imports = {("syncer", "learner"): ["x"], ("report", "launch"): ["y"], ("cli", "launch"): ["z"]}
    assert set(upward(imports)) == {("syncer", "learner"), ("report", "launch")}


# ------------------------------------------------------------------ private attributes
PRIVATE_ALLOWED = {
    "os._exit": "stdlib: leave a process at once, without running its exit handlers",
    "argparse._ArgumentGroup": "stdlib: the type of an argument group, for a type hint",
    "self.diloco._fragments": "torchft's DiLoCo keeps its fragments private; our replica "
    "wraps it (baselines/torchft/replica.py)",
}
"""Private attributes of code that is not ours, read on purpose (expression -> why)."""


def private_reads(source: str) -> list[str]:
    """``X._name`` in ``source`` where ``X`` is not ``self`` or ``cls``: another object's
    private attribute (a dunder is not private)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        if not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_private_attribute_read_across_objects():
    """A part's state is its own: another module reads it through its public contract."""
    offenders = {}
    for path in SRC.rglob("*.py"):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue  # generated by protoc
        reads = [
            r for r in private_reads(path.read_text()) if r.split(": ", 1)[1] not in PRIVATE_ALLOWED
        ]
        if reads:
            offenders[path.relative_to(SRC).as_posix()] = reads
    assert offenders == {}


def test_the_private_read_check_can_fail():
    source = "self._a = 1\nx = cls._b\ny = other._c\nz = self.part._d\nw = obj.__dict__\n"
    assert private_reads(source) == ["3: other._c", "4: self.part._d"]
