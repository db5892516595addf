"""The layer rules of DESIGN.md, enforced: imports point down only (flows -> tasks -> rlhf_core), the library
loads no orchestration package, and the project's modules import one another without cycles. Inside the
library, the trainers' rooms: a family package (rlhf_core/trainers/ppo, online, preference) imports what the
families share (the modules directly in rlhf_core/trainers/) and never another family; what is shared never
imports a family; nothing below the trainers imports them (only the TRL mirror rlhf_core.trainer does).
Inside the pipeline, the stages' rooms: a stage's body (tasks/stages/<stage>.py) imports plumbing and never another
body nor the table (tasks/stages/__init__.py); the plumbing never imports a body, and only the runners (the wrapper,
the supervisor, the registry step) import the table; the flows reach stages through the table, never a body. An
import inside a function names a heavy library (one a light command line must not load at start), with its reason
on the line, never one of the pipeline's own light modules.

The import graph is read from the source with ``ast``: every ``import``/``from ... import`` statement counts,
including those inside functions (a lazy import still ties the two modules together: it only delays the
cycle until the function runs). Relative imports are resolved; ``from package import name`` counts as an
import of ``package.name`` when that is a module, else of ``package``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlhf_core", "tasks", "flows")
ORCHESTRATION = ("prefect", "mlflow", "dvc")


def module_name(path: Path) -> str:
    """``rlhf_core/trainers/ppo/trainer.py`` -> ``rlhf_core.trainers.ppo.trainer``; a package's ``__init__`` ->
    the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imported_names(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every absolute module name ``path`` imports (top level and inside functions), as written."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return found


def project_edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (an import of ``a.b.c`` that is no module counts as ``a.b``)."""
    edges = set()
    for target in imported_names(name, path, modules):
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)
    return edges


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: project_edges(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def top(name: str) -> str:
    return name.split(".")[0]


TRAINERS = "rlhf_core.trainers"
FAMILIES = ("ppo", "online", "preference")
"""The trainer families, one package each under rlhf_core/trainers/; what several share lies beside them."""
TRL_MIRROR = "rlhf_core.trainer"
"""TRL 0.11's ``trl.trainer`` path: re-exports the trainers, so it is the one library room above them."""


def trainer_room(name: str) -> str | None:
    """``"shared"`` for rlhf_core.trainers and a module directly in it, the family for one in a family package,
    None outside the trainers."""
    if name != TRAINERS and not name.startswith(TRAINERS + "."):
        return None
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in FAMILIES else "shared"


def trainer_room_violations(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Imports that point up or sideways among the trainers: a shared module importing a family, a family
    importing another family, or a library module below the trainers (anything in rlhf_core but the trainers,
    the TRL mirror and the package itself, which exports names lazily) importing the trainers."""
    bad: dict[str, list[str]] = {}
    for module, targets in graph.items():
        if top(module) != "rlhf_core" or module == "rlhf_core":
            continue
        room = trainer_room(module)
        if room is None and (module == TRL_MIRROR or module.startswith(TRL_MIRROR + ".")):
            continue
        wrong = sorted(t for t in targets if trainer_room(t) is not None and (
            room is None or (trainer_room(t) in FAMILIES and trainer_room(t) != room)))
        if wrong:
            bad[module] = wrong
    return bad


def test_cycle_finder_finds_a_cycle_and_only_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_from_imports_resolve_to_modules(tmp_path):
    modules = {"pkg": Path("pkg/__init__.py"), "pkg.a": Path("pkg/a.py"), "pkg.sub": Path("pkg/sub/__init__.py"),
               "pkg.sub.b": Path("pkg/sub/b.py")}
    source = tmp_path / "b.py"
    source.write_text("from .. import a\nfrom . import b\nfrom pkg.sub.b import thing\n"
                      "def f():\n    import pkg.a\n")
    assert imported_names("pkg.sub.b", source, modules) == {"pkg.a", "pkg.sub.b"}


def test_rlhf_core_never_imports_the_pipeline():
    graph = import_graph()
    bad = {m: sorted(t for t in targets if top(t) in ("tasks", "flows"))
           for m, targets in graph.items() if top(m) == "rlhf_core"}
    assert {m: t for m, t in bad.items() if t} == {}


def test_rlhf_core_source_never_names_orchestration_packages():
    modules = project_modules()
    bad = {}
    for name, path in modules.items():
        if top(name) != "rlhf_core":
            continue
        names = {n.split(".")[0] for n in imported_names(name, path, modules)}
        if names & set(ORCHESTRATION):
            bad[name] = sorted(names & set(ORCHESTRATION))
    # rlhf_core.tracking's MLflow backend is the one exception DESIGN.md names (imported lazily, inside it)
    assert set(bad) <= {"rlhf_core.tracking"} and set(bad.get("rlhf_core.tracking", [])) <= {"mlflow"}, bad


def test_trainer_rooms_catch_upward_and_sideways_imports():
    graph = {
        "rlhf_core.trainers.ppo.trainer": {"rlhf_core.trainers.forward", "rlhf_core.trainers.ppo.config"},  # fine
        "rlhf_core.trainers.forward": {"rlhf_core.trainers.ppo.trainer"},  # shared -> family
        "rlhf_core.trainers.online.rloo": {"rlhf_core.trainers.preference.dpo"},  # family -> family
        "rlhf_core.models.value_head": {"rlhf_core.trainers.base"},  # below the trainers -> trainers
        "rlhf_core.trainer.ppo_trainer": {"rlhf_core.trainers.ppo.trainer"},  # the TRL mirror: fine
        "tasks.stages.ppo": {"rlhf_core.trainers.ppo.loop"},  # the pipeline: fine
    }
    assert trainer_room_violations(graph) == {
        "rlhf_core.trainers.forward": ["rlhf_core.trainers.ppo.trainer"],
        "rlhf_core.trainers.online.rloo": ["rlhf_core.trainers.preference.dpo"],
        "rlhf_core.models.value_head": ["rlhf_core.trainers.base"],
    }


def test_trainer_families_are_the_packages_on_disk():
    packages = {p.parent.name for p in (ROOT / "rlhf_core" / "trainers").glob("*/__init__.py")}
    assert packages == set(FAMILIES)


def test_trainer_imports_point_down_and_never_sideways_between_families():
    assert trainer_room_violations(import_graph()) == {}


def test_tasks_never_import_flows():
    graph = import_graph()
    bad = {m: sorted(t for t in targets if top(t) == "flows") for m, targets in graph.items() if top(m) == "tasks"}
    assert {m: t for m, t in bad.items() if t} == {}


def test_no_import_cycles_among_project_modules():
    assert find_cycles(import_graph()) == []


FLOORS = {"spec": 0, "process": 0, "store": 1, "stages": 2, "serving": 3, "feedback": 4, "registry": 5, "run": 6}
"""tasks/'s folders, lowest first: a module imports its own folder and the floors below it, never a floor above nor
another folder of its own floor (spec and process stand side by side). What each holds: its ``__init__.py``."""
LEGACY = {"tasks", "tasks.policy_model"}
"""The package itself and the old path registered versions import (tasks/policy_model.py re-exports the new one)."""


def floor(name: str) -> str | None:
    """The folder of tasks/ a module lives in (``tasks.store.outputs`` -> ``store``); None outside tasks/."""
    parts = name.split(".")
    return parts[1] if parts[0] == "tasks" and len(parts) > 1 and name not in LEGACY else None


def floor_violations(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    bad: dict[str, list[str]] = {}
    for module, targets in graph.items():
        here = floor(module)
        if here is None:
            continue
        wrong = sorted(t for t in targets if floor(t) is not None and floor(t) != here
                       and FLOORS[floor(t)] >= FLOORS[here])
        if wrong:
            bad[module] = wrong
    return bad


def test_floors_catch_upward_and_sideways_imports():
    graph = {
        "tasks.store.outputs": {"tasks.process.ranks"},  # down: fine
        "tasks.store.dvc_ops": {"tasks.store.dvc_lockfile"},  # same folder: fine
        "tasks.spec.params": {"tasks.process.logs"},  # sideways on floor 0
        "tasks.serving.answer": {"tasks.feedback.assessments"},  # up
        "flows.pipeline": {"tasks.run.supervisor"},  # outside tasks/: another test's business
    }
    assert floor_violations(graph) == {"tasks.spec.params": ["tasks.process.logs"],
                                       "tasks.serving.answer": ["tasks.feedback.assessments"]}


def test_tasks_modules_live_in_the_floors_and_import_down_only():
    """Issue 31: tasks/ in folders by concern; every module in one of them, imports pointing down."""
    modules = project_modules()
    flat = sorted(n for n in modules if n.startswith("tasks.") and floor(n) is None and n not in LEGACY)
    assert flat == [], "modules outside tasks/'s floors: " + ", ".join(flat)
    folders = {floor(n) for n in modules if floor(n)}
    assert folders == set(FLOORS), folders ^ set(FLOORS)
    assert all((ROOT / "tasks" / f / "__init__.py").read_text().strip() for f in FLOORS)  # each says what it holds
    assert floor_violations(import_graph()) == {}


TABLE = "tasks.stages"
"""The stage table: it names every stage's body."""
COMMON = "tasks.stages.common"
"""What several bodies share: plumbing, not a body."""
RUNNERS = {"tasks.run.stage_task", "tasks.run.supervisor", "tasks.registry.gate", "tasks.run.dvc_yaml"}
"""The pipeline modules that run stages, so read the table: the wrapper, the supervisor, the registry step."""


def stage_room(name: str) -> str | None:
    """``"table"``, ``"body"`` (tasks/stages/<stage>.py), ``"runner"``, ``"plumbing"`` (the rest of tasks/) or
    ``"flows"``; None in the library."""
    if name == TABLE:
        return "table"
    if name.startswith(COMMON + ".") or name == COMMON:
        return "plumbing"
    if name.startswith(TABLE + "."):
        return "body"
    if name in RUNNERS:
        return "runner"
    return {"tasks": "plumbing", "flows": "flows"}.get(top(name))


def stage_room_violations(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Imports that break the stages' rooms: a body importing another body or the table, plumbing importing a
    body or the table, a runner or a flow importing a body directly (they go through the table)."""
    allowed = {"body": {"plumbing"}, "plumbing": {"plumbing"}, "runner": {"plumbing", "table", "runner"},
               "table": {"plumbing", "body"}, "flows": {"plumbing", "table", "runner", "flows"}}
    bad: dict[str, list[str]] = {}
    for module, targets in graph.items():
        room = stage_room(module)
        if room is None:
            continue
        wrong = sorted(t for t in targets if stage_room(t) is not None and stage_room(t) not in allowed[room])
        if wrong:
            bad[module] = wrong
    return bad


def test_stage_rooms_catch_sideways_and_upward_imports():
    graph = {
        "tasks.stages.kto": {"tasks.stages.common.policy", "tasks.stages.common.samples"},  # fine
        "tasks.stages.grpo": {"tasks.stages.rloo"},  # body -> body
        "tasks.stages.ppo": {"tasks.stages"},  # body -> table
        "tasks.stages.common.scoring": {"tasks.stages.evaluate"},  # plumbing -> body
        "tasks.stages.common.samples": {"tasks.stages", "tasks.run.stage_task"},  # plumbing -> table, plumbing -> runner
        "tasks.run.stage_task": {"tasks.stages", "tasks.store.outputs"},  # fine
        "flows.stage": {"tasks.stages.sft"},  # a flow -> a body
        "flows.pipeline": {"tasks.stages", "tasks.run.supervisor"},  # fine
    }
    assert stage_room_violations(graph) == {
        "tasks.stages.grpo": ["tasks.stages.rloo"], "tasks.stages.ppo": ["tasks.stages"],
        "tasks.stages.common.scoring": ["tasks.stages.evaluate"], "tasks.stages.common.samples": ["tasks.run.stage_task", "tasks.stages"],
        "flows.stage": ["tasks.stages.sft"],
    }


def test_stage_bodies_plumbing_and_flows_keep_their_rooms():
    assert stage_room_violations(import_graph()) == {}


HEAVY = {"torch", "transformers", "datasets", "accelerate", "diffusers", "huggingface_hub", "mlflow", "dvc",
         "prefect", "matplotlib", "pandas", "rlhf_core", "tasks.stages.common.resume", "tasks.run.orphans", "flows.retrain",
         "tasks.registry.policy_pyfunc", "tasks.serving.answer", "tasks.stages.common.scoring"}
"""What a function may import (to keep a light command line light): heavy libraries, the library (its modules load
torch or transformers, but :data:`LIGHT`), and the pipeline modules that load one of those at import
(tasks.stages.common.resume: transformers; tasks.run.orphans: torch, for flows/process.py, which loads before torch; flows.retrain:
torch, for the intake's retraining; tasks.registry.policy_pyfunc and tasks.serving.answer: mlflow, for the registry step;
tasks.stages.common.scoring: torch, for the review page, which imports tasks.serving.answer)."""
LIGHT = {"rlhf_core.tracking", "rlhf_core.model_card", "rlhf_core.data", "rlhf_core.feedback"}
"""Library modules that load no heavy library: imported at the top."""


def lazy_imports(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module, source line)`` of every import inside a function of ``path``."""
    text = path.read_text(encoding="utf-8")
    lines, found = text.splitlines(), []
    for function in ast.walk(ast.parse(text)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                found += [(node.lineno, alias.name, lines[node.lineno - 1]) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                found.append((node.lineno, node.module or "", lines[node.lineno - 1]))
    return sorted(set(found))


def test_imports_inside_functions_are_heavy_and_say_why():
    """Issue 25: imports inside function bodies only where they must be lazy, each place with a short reason: the
    first import of each run of them carries a comment on its line (or its function's docstring says why)."""
    light, silent = [], []
    for name, path in project_modules().items():
        if top(name) not in ("tasks", "flows"):
            continue
        found = lazy_imports(path)
        for line, module, source in found:
            if module in LIGHT or not any(module == heavy or module.startswith(heavy + ".") for heavy in HEAVY):
                light.append(f"{path.relative_to(ROOT)}:{line}: {module}")
        runs = [(line, source) for i, (line, _, source) in enumerate(found) if i == 0 or found[i - 1][0] < line - 3]
        silent += [f"{path.relative_to(ROOT)}:{line}" for line, source in runs if "#" not in source]
    assert light == [], "light modules imported inside functions (import them at the top): " + ", ".join(light)
    assert silent == [], "lazy imports without a reason on the line: " + ", ".join(silent)


IMPORT_ALL = """
import importlib, json, pkgutil, sys
import rlhf_core
failed = {}
for info in pkgutil.walk_packages(rlhf_core.__path__, "rlhf_core."):
    if info.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(info.name)
    except ImportError as error:  # an optional extra that is not installed (reported, checked by the caller)
        failed[info.name] = repr(error)
loaded = sorted({name.split(".")[0] for name in sys.modules})
print(json.dumps({"loaded": loaded, "failed": failed}))
"""


def test_importing_all_of_rlhf_core_loads_no_orchestration_or_pipeline():
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["failed"] == {}, report["failed"]
    assert set(report["loaded"]) & {*ORCHESTRATION, "tasks", "flows"} == set()
