"""The package stays a house a newcomer can live in: no import cycles, no function over 80 lines.

Imports are read with `ast`, including imports inside functions (a late import hides a cycle rather than
removing it) and the package `__init__` that importing a submodule runs first. Imports under
`if TYPE_CHECKING:` never run and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "src" / "parallel_train"
MAX_FUNCTION_LINES = 80
MAX_TRAINER_LINES = 250  # the Trainer class (issue 37: it reads top to bottom)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of import nodes inside `if TYPE_CHECKING:` blocks."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skip.update(id(n) for n in ast.walk(node))
    return skip


def imported(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that importing `path` may import, with the packages their import runs first."""
    name, tree = module_name(path), ast.parse(path.read_text())
    skip, targets = _type_checking_only(tree), set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                package = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join(package + ([node.module] if node.module else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    found = set()
    for target in targets:
        parts = target.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))  # a.b.c runs a, then a.b, then a.b.c
    return {m for m in found if m in modules and m != name and not name.startswith(m + ".")}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imported(path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_in_the_package():
    graph = import_graph()
    assert len(graph) > 20 and "parallel_train.trainer" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_function_in_the_package_is_over_80_lines():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, "functions over 80 lines (give them named parts): " + ", ".join(long)


# The floors of the house, lowest first (docs/contributing.md, "Project layout"). A module may import modules on its
# own floor or below, never above: models and data never reach for an engine, checkpoints never for the trainer.
# Floors hold rooms only (a top-level module or a subpackage): what rooms on several floors share lives in core/.
FLOORS = {
    0: ("errors", "faults", "losses", "eval_metrics", "core"),
    1: ("models",),
    2: ("config", "data", "optim", "tasks"),
    3: ("checkpoint", "observe", "run"),
    4: ("parallel",),
    5: ("step", "evaluation", "guards"),
    6: ("trainer", "cli"),
}


def floor(module: str) -> int:
    """The floor of `parallel_train.<room>...`: of its room (a top-level module or a subpackage)."""
    room = module.removeprefix("parallel_train.").split(".")[0]
    found = [f for f, rooms in FLOORS.items() if room in rooms]
    assert found, f"{module}: its room {room} is on no floor: add it to FLOORS"
    return found[0]


def test_floors_name_rooms_only():
    """A floor holds whole rooms, so the folder names say the layering: no module inside a room is on a floor of its
    own (a piece that rooms on several floors share moves to core/), and every room is on exactly one floor."""
    named = [room for rooms in FLOORS.values() for room in rooms]
    assert not [room for room in named if "." in room], "FLOORS names a module inside a room: move it to a room"
    assert len(named) == len(set(named)), "a room on two floors"
    rooms = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    rooms |= {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert rooms == set(named), f"rooms on no floor: {sorted(rooms - set(named))}; floors naming no room: {sorted(set(named) - rooms)}"


def test_no_module_imports_a_floor_above_its_own():
    """Dependency direction, room by room: a lower floor never imports a higher one (package __init__ files hold only
    docstrings, so importing `parallel_train.run.resume` runs nothing of run/ but resume.py and what it imports)."""
    packages = {module_name(p) for p in PACKAGE.rglob("__init__.py")}
    up = []
    for module, targets in import_graph().items():
        if module in packages:
            continue
        up += [f"{module} (floor {floor(module)}) -> {t} (floor {floor(t)})" for t in targets - packages if floor(t) > floor(module)]
    assert not up, "imports that climb a floor: " + "; ".join(sorted(up))


def test_package_init_files_are_docstrings_only():
    """Each subpackage says what lives there and what it may import, and runs nothing (no import cycles through them)."""
    for init in PACKAGE.rglob("__init__.py"):
        if init.parent.name in ("models",):  # the model registry is the one package whose __init__ is code
            continue
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree) and len(tree.body) == 1, f"{init.relative_to(REPO)}: a docstring and nothing else"


def test_the_trainer_is_at_most_250_lines_and_reads_top_to_bottom():
    """The Trainer keeps the run's order and hands each phase to its room (run/, observe/, evaluation.py, ...): its class
    is at most 250 lines, set-up first, then the loop, then the end."""
    tree = ast.parse((PACKAGE / "trainer.py").read_text())
    (trainer,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Trainer"]
    lines = trainer.end_lineno - trainer.lineno + 1
    assert lines <= MAX_TRAINER_LINES, f"the Trainer class is {lines} lines: move a phase to the room it belongs to"
    methods = [node.name for node in trainer.body if isinstance(node, ast.FunctionDef)]
    order = [methods.index(name) for name in ("__init__", "run", "train", "finish", "close")]
    assert order == sorted(order), f"the Trainer's methods out of order (set up, the loop, the end): {methods}"


def test_at_most_ten_modules_at_the_top_of_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 10, top


def test_every_task_name_has_its_module_in_the_registry():
    """model.task's choices (core/task.py) and the registry (tasks/registry.py) name the same tasks, and the models'
    table of Auto classes (core/task.py AUTO_CLASSES) says what each task module says."""
    from parallel_train.core.task import AUTO_CLASSES, LABELLED, TASK_NAMES
    from parallel_train.tasks.registry import TASKS

    assert tuple(TASKS) == TASK_NAMES
    assert AUTO_CLASSES == {name: task.auto_class for name, task in TASKS.items()}
    assert LABELLED == tuple(name for name, task in TASKS.items() if task.has_labels)
