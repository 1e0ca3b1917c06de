"""The package's shape (issue 25): small modules, classes and functions, and no import circle.

Read from the sources with ast, so a lazy import inside a function counts as much as one at the
top: a circle through one is still a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "orchestrator"
MODULE_LINES = 450
CLASS_LINES = 200
FUNCTION_LINES = 50
WHOLE = {"orchestrator.node.protocol.wire"}  # the protocol's vocabulary stays in one place, whatever its size


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            modules = {f"{target}.{a.name}" for a in node.names} & known.keys()  # `from .node import wire`
            found |= modules
            if node.module or not modules:  # `from .job import Job`: the module itself
                found |= {target} & known.keys()
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} & known.keys()
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & known.keys()
    return found - {name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
    return found


def test_the_circle_finder_finds_a_circle_through_a_lazy_import():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    known = modules()
    assert circles({name: imported(name, path, known) for name, path in known.items()}) == []


# The pipeline's stages, first to last: a stage imports only the stages before it (lazy imports too).
STAGES = ("node", "config", "plan", "remote", "diagnose", "job", "views", "run", "commands")
LEAVES = {"errors", "ownfiles", "clean", "version"}  # every stage's; they import only each other
FACES = {"orchestrator", "orchestrator.api"}  # the package's face, above every stage; nothing imports it


def stage_of(name: str) -> str:
    if name in FACES:
        return "face"
    part = name.split(".")[1]
    return "leaf" if part in LEAVES else part


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports against the stages' order: to a later stage, or to the face, or a leaf's to a stage."""
    wrong = []
    for name, targets in graph.items():
        here = stage_of(name)
        for target in sorted(targets):
            there = stage_of(target)
            if there == "face" and name not in FACES or here == "leaf" and there != "leaf":
                wrong.append((name, target))
            elif here not in ("face", "leaf") and there not in ("face", "leaf") and STAGES.index(there) > STAGES.index(here):
                wrong.append((name, target))
    return wrong


def test_the_order_check_finds_an_import_of_a_later_stage():
    graph = {"orchestrator.plan.launch": {"orchestrator.config.cluster", "orchestrator.job.loop"},
             "orchestrator.errors": {"orchestrator.node.protocol.wire"}, "orchestrator.views.console": {"orchestrator.api"},
             "orchestrator.job.loop": {"orchestrator.clean", "orchestrator.job.events", "orchestrator.remote.channel"}}
    assert sorted(upward(graph)) == [("orchestrator.errors", "orchestrator.node.protocol.wire"),
                             ("orchestrator.plan.launch", "orchestrator.job.loop"),
                             ("orchestrator.views.console", "orchestrator.api")]


def test_every_module_is_in_a_stage_or_a_leaf():
    assert {name for name in modules() if stage_of(name) not in (*STAGES, "leaf", "face")} == set()


def test_the_stages_import_one_way():
    known = modules()
    assert upward({name: imported(name, path, known) for name, path in known.items()}) == []


def test_each_stage_says_what_it_does_and_what_it_may_import():
    for stage in STAGES:
        doc = ast.get_docstring(tree(PACKAGE / stage / "__init__.py")) or ""
        allowed = "It imports nothing of the controller's" if stage == "node" else "May import"
        assert allowed in doc, stage


LOOP = "orchestrator.job.loop"  # the one module that changes a Job's state
MUTATORS = {"add", "append", "extend", "update", "clear", "discard", "pop", "remove", "insert", "setdefault"}


def root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def on_a_job(node: ast.AST) -> bool:
    """Whether an attribute chain starts at a Job: ``job.…`` or ``self.job.…``."""
    base = root(node)
    if isinstance(base, ast.Name) and base.id == "job":
        return node is not base
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute) and node.attr == "job" and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            return True
        node = node.value
    return False


def job_handling(source: str) -> list[str]:
    """Where code keeps a Job (``self.job = …``) or changes one: a store into its attributes, or a
    mutating call on one of them (``job.seen.add(…)``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            targets = []
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr == "job" and isinstance(target.value, ast.Name):
                found.append(f"line {target.lineno}: keeps a Job")
            elif isinstance(target, (ast.Attribute, ast.Subscript)) and on_a_job(target):
                found.append(f"line {target.lineno}: writes a Job's attribute")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS \
                and on_a_job(node.func.value):
            found.append(f"line {node.lineno}: changes a Job's attribute")
    return found


def test_the_job_check_finds_a_job_kept_or_changed():
    source = ("class R:\n    def __init__(self, job):\n        self.job = job\n"
              "    def f(self, job):\n        job.port = 1\n        self.job.seen.add(2)\n"
              "        job.following.later |= True\n        n = job.port\n")
    assert job_handling(source) == ["line 3: keeps a Job", "line 5: writes a Job's attribute",
                                    "line 7: writes a Job's attribute", "line 6: changes a Job's attribute"]


def test_only_the_job_loop_changes_a_jobs_state():
    """loop.py's promise: the report handlers, the phases and the pace tracking return values or
    asks (job/events.py) and the loop applies them; nothing else keeps a Job or writes into one."""
    found = {name: job_handling(path.read_text(encoding="utf-8")) for name, path in modules().items() if name != LOOP}
    assert {name: where for name, where in found.items() if where} == {}


@pytest.mark.parametrize("name", sorted(modules()))
def test_small_modules_classes_and_functions(name):
    path = modules()[name]
    too_big = []
    lines = len(path.read_text(encoding="utf-8").splitlines())
    if lines > MODULE_LINES and name not in WHOLE:
        too_big.append(f"module: {lines} lines")
    for node in ast.walk(tree(path)):
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        size = node.end_lineno - node.lineno + 1
        if isinstance(node, ast.ClassDef) and size > CLASS_LINES:
            too_big.append(f"class {node.name}: {size} lines")
        elif not isinstance(node, ast.ClassDef) and size > FUNCTION_LINES:
            too_big.append(f"function {node.name}: {size} lines")
    assert not too_big, too_big


# The node agent's house: its rooms, first to last (node.ROOMS); a room imports only rooms before it,
# and the house's own modules (main, oneshot) import any room; no room imports them.
def room_of(name: str) -> str:
    from orchestrator import node

    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in node.ROOMS else "house"


def node_upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The node modules' imports against the rooms' order."""
    from orchestrator import node

    order = list(node.ROOMS) + ["house"]
    return [(name, target) for name, targets in graph.items() if name.startswith("orchestrator.node.")
            for target in sorted(targets) if target.startswith("orchestrator.node.")
            and order.index(room_of(target)) > order.index(room_of(name))]


def test_the_room_check_finds_an_import_of_a_later_room():
    graph = {"orchestrator.node.watch.relay": {"orchestrator.node.local.state", "orchestrator.node.attempt.run"},
             "orchestrator.node.protocol.wire": {"orchestrator.node.main"},
             "orchestrator.node.main": {"orchestrator.node.supervise.detached"}}
    assert node_upward(graph) == [("orchestrator.node.watch.relay", "orchestrator.node.attempt.run"),
                                  ("orchestrator.node.protocol.wire", "orchestrator.node.main")]


def test_the_node_s_rooms_import_one_way():
    known = modules()
    assert node_upward({name: imported(name, path, known) for name, path in known.items()}) == []


def test_each_room_of_the_node_says_what_it_does_and_what_it_may_import_and_holds_what_it_lists():
    from orchestrator import node

    here = PACKAGE / "node"
    for room, names in node.ROOMS.items():
        doc = ast.get_docstring(tree(here / room / "__init__.py")) or ""
        assert "May import" in doc or "Imports nothing" in doc, room
        on_disk = {p.stem for p in (here / room).glob("*.py")} - {"__init__"}
        assert on_disk == set(names) | {n.split(".")[1] for n in node.IN_IMAGE if n.startswith(room + ".")}, room
    assert {p.name for p in here.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(node.ROOMS)


def test_the_node_keeps_a_handful_of_modules_of_its_own():
    from orchestrator import node

    own = {p.stem for p in (PACKAGE / "node").glob("*.py")} - {"__init__"}
    assert own == set(node.HOUSE) | {"boot"} and len(own) <= 5


def test_a_method_that_overrides_one_takes_what_that_one_takes():
    """DetachedRun.stop once lagged a parameter behind Runner.stop: every detached job's agent then
    died of a TypeError at ddp-kill (a stop it could not take). A method that overrides another (in
    the node's package, and the controller's) takes the same parameters."""
    import importlib
    import inspect
    import pkgutil

    import orchestrator

    lagging = []
    for info in pkgutil.walk_packages(orchestrator.__path__, "orchestrator."):
        if info.name.endswith(("_probe", "rank_call")) or ".userpython." in info.name:
            continue  # run in the user's Python (torch, the rank): not imported here
        module = importlib.import_module(info.name)
        for cls in [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == info.name]:
            for name, method in vars(cls).items():
                if not inspect.isfunction(method) or name.startswith("__"):
                    continue
                base = next((vars(b)[name] for b in cls.__mro__[1:] if name in vars(b)), None)
                if not inspect.isfunction(base):
                    continue
                mine, theirs = inspect.signature(method).parameters, inspect.signature(base).parameters
                by_keyword = [p for p, v in theirs.items() if v.default is not inspect.Parameter.empty]
                if len(mine) < len(theirs) or any(p not in mine for p in by_keyword):  # callers pass those by name
                    lagging.append(f"{info.name}.{cls.__name__}.{name}")
    assert not lagging, lagging
