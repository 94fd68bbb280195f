"""The package's layout (issue 56, docs/layout.md): the root holds the core, each other concern is a folder; imports
run one way at every depth (module level, inside functions, under ``if TYPE_CHECKING``, and a package's
``__init__`` that importing one of its modules runs); each part imports only what the layout allows; no class over
400 lines, no module over 500; every name the docs show imports. None of these tests starts a process."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Optional

import pytest

from conftest import ROOT

PKG = ROOT / "distkit"

#: the root's modules: the core (docs/layout.md); ``lightning.py``, ``hf.py`` and ``speechbrain.py`` are the documented import paths of
#: the bridges in integrations/ (re-exports, nothing else)
ROOT_MODULES = {"__init__", "__main__", "session", "job", "env", "errors", "data", "evaluation", "trainer",
                "components", "portable", "report", "main_process", "lightning", "hf", "speechbrain"}
FOLDERS = {"launch", "ft", "sync", "health", "commands", "integrations", "config", "backends", "checkpoint", "tasks",
           "trackers", "compat"}

#: imports left out of the circle check, each with its reason: (importer, imported) module names
NOT_EDGES: dict[tuple[str, str], str] = {
    ("distkit.backends", "distkit.backends.deepspeed"):
        "an optional heavy dependency (the package imports deepspeed, seconds): the registry imports it by name "
        "when a config selects it; its engine writes the resolved DeepSpeed config with the checkpoint package's "
        "atomic JSON writer, and the checkpoint package types the engine by the Strategy ABC",
}
#: string-named imports (``importlib.import_module`` of a table's entries) that the circle check reads, by table
STRING_TABLES = {"distkit.backends": "REGISTRY", "distkit.commands.cli": "COMMANDS"}
#: the CLI's lazy subcommands: imported only when named (``distkit keys`` starts without torch); not a circle
#: (nothing imports the CLI) but an import at a distance, listed here so that a new one is seen
LAZY_SUBCOMMANDS = {"distkit.commands.inspection", "distkit.commands.export", "distkit.commands.convert",
                    "distkit.commands.sbatch", "distkit.commands.lighthouse", "distkit.commands.envreport",
                    "distkit.commands.plot"}

#: what each part may import of distkit (docs/layout.md, "Map of the package"): a part is a root module or a
#: folder; every import of any kind counts
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(), "env": {"errors"}, "trackers": {"errors"},
    "launch": {"errors", "env"},
    "sync": {"errors"},
    "config": {"errors", "env", "launch", "sync", "trackers", "ft"},  # validation: nprocs, codecs, trackers, ft.checks
    "components": {"errors", "config"},
    "portable": {"errors", "env"},
    "main_process": {"env"},
    "health": {"errors", "env", "launch", "config"},
    "tasks": {"errors", "config", "main_process"},
    "ft": {"errors", "env", "config", "launch", "sync", "health", "backends"},  # backends: the Strategy type only
    "backends": {"errors", "env", "config", "launch", "sync", "health", "portable", "checkpoint"},
    "checkpoint": {"errors", "env", "config", "health", "portable", "backends"},
    "data": {"errors", "config", "ft"},
    "evaluation": {"errors", "data", "tasks"},
    "report": {"backends", "config", "env", "evaluation"},
    "job": {"errors", "env", "config", "components", "launch", "health", "backends"},
    "session": {"errors", "env", "config", "components", "launch", "health", "backends", "checkpoint", "data", "ft",
                "job", "main_process", "report"},
    "trainer": {"errors", "env", "config", "components", "health", "checkpoint", "evaluation", "session", "tasks",
                "trackers"},
    "compat": {"errors", "env", "config", "launch", "health", "backends", "portable", "session"},
    "integrations": {"errors", "env", "config", "components", "health", "backends", "checkpoint", "portable",
                     "session"},
    "lightning": {"integrations"}, "hf": {"integrations"}, "speechbrain": {"integrations"},
    "commands": {"errors", "env", "config", "components", "launch", "health", "backends", "checkpoint", "portable",
                 "ft", "tasks", "trainer", "trackers"},
    "__main__": {"commands"},
}

#: the engines' modules in backends/ (each registered in backends/__init__.py); the other modules there are
#: their shared parts and helpers, which never import an engine
ENGINES = {"distkit.backends.ddp", "distkit.backends.mpi", "distkit.backends.horovod", "distkit.backends.fsdp",
           "distkit.backends.deepspeed.engine", "distkit.backends.deepspeed"}
#: an engine built on another one's parts: (engine, engine it imports)
ENGINE_ON_ENGINE = {("distkit.backends.horovod", "distkit.backends.mpi"), ("distkit.backends.fsdp", "distkit.backends.ddp"),
                    ("distkit.backends.deepspeed.config", "distkit.backends.ddp")}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _string_imports(name: str, tree: ast.Module) -> set[str]:
    """The modules a string table of ``name`` names (``"distkit.backends.ddp:DDPStrategy"``)."""
    table = STRING_TABLES.get(name)
    found: set[str] = set()
    for node in ast.walk(tree):
        target = node.targets[0] if isinstance(node, ast.Assign) else node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == table and isinstance(node.value, ast.Dict):  # type: ignore[union-attr]
            found |= {v.value.partition(":")[0] for v in node.value.values  # type: ignore[union-attr]
                      if isinstance(v, ast.Constant) and isinstance(v.value, str)}
    return found


def import_graph() -> dict[str, dict[str, str]]:
    """Every distkit module and the distkit modules its imports run, with the kind of the first such import:
    "top" (module level), "lazy" (inside a function), "type" (under ``if TYPE_CHECKING``), "string" (a table read by
    ``importlib``). Importing ``a.b.c`` runs ``a.b``'s ``__init__`` too: an edge to each package above the module,
    except the importer's own packages (already running). The package root (``distkit``) is left out: it
    re-exports the API lazily (PEP 562)."""
    paths = _modules()
    graph: dict[str, dict[str, str]] = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for top in ast.walk(tree) if isinstance(top, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(top.test) for n in ast.walk(top)}
        in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(f)}
        deps: dict[str, str] = {}

        def add(target: str, kind: str) -> None:
            while target and target not in paths:
                target = target.rpartition(".")[0]
            while target:
                if target in paths and target != name and target != "distkit" and not name.startswith(target + "."):
                    deps.setdefault(target, kind)
                target = target.rpartition(".")[0]

        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                kind = "type" if id(node) in typing_only else "lazy" if id(node) in in_function else "top"
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                else:
                    base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                        if node.level else node.module or ""
                    targets = [base] + [f"{base}.{a.name}" for a in node.names]
                for t in targets:
                    if t.startswith("distkit"):
                        add(t, kind)
        for t in _string_imports(name, tree):
            add(t, "string")
        graph[name] = {d: k for d, k in deps.items() if (name, d) not in NOT_EDGES}
    graph.pop("distkit", None)
    return graph


def find_circle(graph: dict[str, dict[str, str]]) -> Optional[list[str]]:
    """A circle of imports (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> Optional[list[str]]:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (found := visit(d)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def _part(module: str) -> str:
    return module.split(".")[1]


def test_the_root_holds_the_core_and_each_other_concern_is_a_folder() -> None:
    root = {p.stem for p in PKG.glob("*.py")}
    assert root == ROOT_MODULES and len(root) <= 16, sorted(root ^ ROOT_MODULES)
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == FOLDERS, sorted(folders ^ FOLDERS)
    for public in ("lightning", "hf"):  # re-exports only: no code of their own
        tree = ast.parse((PKG / f"{public}.py").read_text())
        assert not [n for n in tree.body if isinstance(n, ast.ClassDef)], public


def test_the_circle_finder_finds_circles() -> None:
    """The check below can fail: a circle through a lazy import and one through a type-only import are found."""
    assert find_circle({"a": {"b": "top"}, "b": {"c": "lazy"}, "c": {"a": "type"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b": "top"}, "b": {}, "c": {"a": "type"}}) is None


def test_no_import_circle_at_any_depth() -> None:
    """Issue 56: no module reaches itself through any import: module level, inside a function, under
    ``if TYPE_CHECKING``, a registry's string, or the package ``__init__`` an import runs. On a circle the
    assertion names its modules."""
    graph = import_graph()
    # the graph is real: each kind of edge is read
    assert len(graph) > 100
    assert graph["distkit.checkpoint"]["distkit.checkpoint.save"] == "top"
    assert graph["distkit.ft.groups"]["distkit.backends.base"] == "type"
    assert graph["distkit.config.validate"]["distkit.launch.spawner"] == "lazy"
    assert graph["distkit.backends"]["distkit.backends.mpi"] == "string"
    assert graph["distkit.session"]["distkit.backends"] == "top"  # a package's __init__, run by its module's import
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle or [])
    lazy_cli = _string_imports("distkit.commands.cli", ast.parse((PKG / "commands" / "cli.py").read_text()))
    assert lazy_cli == LAZY_SUBCOMMANDS, sorted(lazy_cli ^ LAZY_SUBCOMMANDS)


def test_each_part_imports_only_what_the_layout_allows() -> None:
    """docs/layout.md's map, as a table: a new import across parts is either in the map or fails here."""
    graph = import_graph()
    bad = sorted(f"{m} -> {d} ({k})" for m, deps in graph.items() for d, k in deps.items()
                 if _part(m) != _part(d) and _part(d) not in MAY_IMPORT.get(_part(m), set()))
    assert not bad, "\n".join(bad)
    assert set(MAY_IMPORT) == {_part(m) for m in graph}, sorted(set(MAY_IMPORT) ^ {_part(m) for m in graph})


def test_engine_helpers_never_import_their_engine() -> None:
    """The engines' own helper modules (the mpi reducer, the fsdp copier and averager, DeepSpeed's groups and
    state) import the engines' shared parts, never an engine; the config and the Job reach an engine only through
    the registry (by name)."""
    graph = import_graph()
    for m, deps in graph.items():
        if m.startswith("distkit.backends") and m not in ENGINES and m != "distkit.backends":
            assert not {d for d in deps if d in ENGINES and (m, d) not in ENGINE_ON_ENGINE}, (m, deps)
        if not m.startswith("distkit.backends"):
            assert not {d for d in deps if d in ENGINES} - {"distkit.backends.deepspeed"} or \
                m.startswith(("distkit.commands", "distkit.integrations")), (m, deps)
    assert not {d for d in graph["distkit.trainer"] if d.startswith("distkit.backends")}  # the loop: no engine


def test_no_class_over_400_lines_and_no_module_over_500() -> None:
    big = []
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        if text.count("\n") > 500:
            big.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno and node.end_lineno - node.lineno + 1 > 400:
                big.append(f"{name}: class {node.name} {node.end_lineno - node.lineno + 1} lines")
    assert not big, big


def _doc_names() -> set[str]:
    """Every dotted distkit name the README and docs/ show: ``from distkit.x import a, b`` (each name) and
    ```distkit.x.y``` in backticks."""
    names: set[str] = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for mod, items in re.findall(r"from (distkit(?:\.\w+)*) import ([\w, ]+)", text):
            names |= {f"{mod}.{i.split()[0]}" for i in items.split(",") if i.strip()}  # "A as B": A
        names |= set(re.findall(r"`(distkit(?:\.\w+)+)(?:`|\()", text))
        names |= {m for m in re.findall(r"python -m (distkit(?:\.\w+)*)", text)}
    return names | PUBLIC


#: the public paths issue 56 names, whatever the docs show
PUBLIC = {"distkit.init", "distkit.Trainer", "distkit.run_on_main", "distkit.is_main_process", "distkit.Session",
          "distkit.add_arguments", "distkit.lightning.DistkitStrategy", "distkit.lightning.DistkitFabricStrategy",
          "distkit.hf.ParamSync", "distkit.hf.DistkitTrainer", "distkit.compat.perceptrain", "distkit.portable.load_into",
          "distkit.checkpoint.exists", "distkit.commands.cli.entry"}
#: dotted names in the docs that are not Python names, with what they are
NOT_PYTHON = {"distkit.run_id": "the MLflow tag distkit sets on a run (docs/trackers.md)"}


@pytest.mark.parametrize("name", sorted(_doc_names()))
def test_every_name_the_docs_show_imports(name: str) -> None:
    """Issue 56 item 2: the public paths keep working, and so does every path the docs name (a name that moved
    is changed in the docs, not shimmed)."""
    if name in NOT_PYTHON:
        return
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            assert hasattr(obj, attr), f"{name}: {'.'.join(parts[:cut])} has no {attr}"
            obj = getattr(obj, attr)
        return
    raise AssertionError(f"{name}: no such module")


def _third_party_imports(path: Path) -> set[str]:
    """The top-level packages a module imports (any depth in it, lazy ones too), not distkit's own."""
    tree = ast.parse(path.read_text())
    names = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return {m.split(".")[0] for m in names if m and not m.startswith("distkit")}


def test_only_the_integrations_import_the_frameworks_and_nothing_imports_them() -> None:
    """Issue 39: the frameworks are optional extras. distkit.integrations.lightning* import Lightning and
    distkit.integrations.hf Accelerate (transformers, a model library, stays a lazy import of the tasks and of
    hf_trainer); no other module imports either framework, and nothing of distkit imports the integrations but
    their documented paths (distkit.lightning, distkit.hf, distkit.speechbrain); SpeechBrain likewise (issue 58)."""
    frameworks = {"lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "speechbrain", "returnn"}
    bridges = {"distkit.integrations.lightning": {"lightning"}, "distkit.integrations.hf": {"accelerate"},
               "distkit.integrations.speechbrain": {"speechbrain"}, "distkit.integrations.returnn": {"returnn"}}
    seen: dict[str, set[str]] = {}
    for name, path in _modules().items():
        bridge = next((b for b in bridges if name == b or name.startswith(b + "_")), None)
        used = _third_party_imports(path) & frameworks
        if bridge is None:
            assert not used, f"{name} imports {used}: only the Lightning, Hugging Face and SpeechBrain integrations may"
        else:
            seen[bridge] = seen.get(bridge, set()) | used
    assert seen == bridges, seen  # the bridges exist and import what they bridge
    for name, deps in import_graph().items():
        if not name.startswith("distkit.integrations") and name not in ("distkit.lightning", "distkit.hf",
                                                                         "distkit.speechbrain"):
            assert not {d for d in deps if d.startswith("distkit.integrations")}, (name, deps)
