"""The front-door conformance table (tests/front_doors.py, issue 57) against the tests it cites and the docs.

Every test the table names exists (read from its file's syntax tree: the function, and for a parametrized test the
case's id); no cell claims a result without a test, "not offered" stands exactly where a bridge does not take the
engine or mode, a refusal's phrases are text of the test file that asserts it; docs/integrations.md shows the table
as :func:`front_doors.render_table` renders it. None of these tests starts a process (the cited tests' jobs run in
their own files).
"""
from __future__ import annotations

import ast
import itertools
from pathlib import Path
from typing import Optional


import front_doors as fd
from conftest import ROOT, TIER_REPORT

HEADING = "## The front-door conformance table (tests/front_doors.py)"
#: the section the table's section follows in docs/integrations.md
AFTER = "## What each engine does inside each framework"


def _value_id(value: object, argname: str, index: int) -> str:
    """pytest's id of one parameter value: strings, numbers, booleans and None as written; else ``argnameINDEX``."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return str(value)
    return f"{argname}{index}"


def _is_param_call(node: ast.AST) -> bool:
    """``pytest.param(...)``."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "param"


def _parametrize_ids(call: ast.Call) -> Optional[list[str]]:
    """The case ids of one ``@pytest.mark.parametrize(names, values[, ids=...])`` whose arguments are literals (and
    ``pytest.param(..., id=...)``); None where they are not (computed at collection: not resolvable from the file)."""
    try:
        names = ast.literal_eval(call.args[0])
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        given = next((k.value for k in call.keywords if k.arg == "ids"), None)
        if given is not None:
            return [str(i) for i in ast.literal_eval(given)]
        values = call.args[1] if len(call.args) > 1 else next(k.value for k in call.keywords if k.arg == "argvalues")
        if not isinstance(values, (ast.List, ast.Tuple)):
            return None
        ids = []
        for index, element in enumerate(values.elts):
            explicit = None
            if _is_param_call(element):
                assert isinstance(element, ast.Call)
                explicit = next((ast.literal_eval(k.value) for k in element.keywords if k.arg == "id"), None)
                parts = [ast.literal_eval(a) for a in element.args]
            else:
                value = ast.literal_eval(element)
                parts = list(value) if len(names) > 1 else [value]
            ids.append(str(explicit) if explicit is not None else
                       "-".join(_value_id(v, n, index) for v, n in zip(parts, names, strict=True)))
        return ids
    except (ValueError, TypeError, SyntaxError, StopIteration, IndexError):
        return None


def _is_parametrize(node: ast.AST) -> bool:
    """``@pytest.mark.parametrize(...)`` (or ``@mark.parametrize``)."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "parametrize"


def resolve(nodeid: str, root: Path = ROOT) -> Optional[str]:
    """Why the test ``nodeid`` (``tests/test_x.py::test_f[case]``, or ``::Class::test_f``) does not exist in its
    file as written, or None where it does: the file, the function (in the class), and a parametrized case's id
    among the ids its literal ``parametrize`` decorators give (stacked ones joined as pytest joins them)."""
    path, _, rest = nodeid.partition("::")
    name, _, case = rest.partition("[")
    case = case[:-1] if case.endswith("]") else case
    file = root / path
    if not file.is_file():
        return f"{nodeid}: no file {path}"
    body: list[ast.stmt] = ast.parse(file.read_text()).body
    *classes, function = name.split("::")
    for cls in classes:
        found = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == cls), None)
        if found is None:
            return f"{nodeid}: no class {cls} in {path}"
        body = found.body
    fn = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function), None)
    if fn is None:
        return f"{nodeid}: no function {function} in {path}"
    decorators = [d for d in fn.decorator_list if _is_parametrize(d)]
    if not case:
        return f"{nodeid}: parametrized: name one case" if decorators else None
    if not decorators:
        return f"{nodeid}: {function} is not parametrized"
    lists = [_parametrize_ids(d) for d in reversed(decorators)]  # (the decorator nearest the function: first id part)
    if any(ids is None for ids in lists):
        return f"{nodeid}: its parametrize arguments are not literals: cite a test whose cases the file spells out"
    ids = {"-".join(parts) for parts in itertools.product(*lists)}  # type: ignore[arg-type]
    return None if case in ids else f"{nodeid}: no case {case!r} (cases: {sorted(ids)})"


def _strings(path: Path) -> list[str]:
    """Every string constant of a file (implicitly joined literals as one), f-strings' literal parts too."""
    return [n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


SAMPLE = '''

@pytest.mark.parametrize("name", ["best", "best-outer"])
def test_plain(name): ...

@pytest.mark.parametrize("a,b", [(1, "x"), pytest.param(2, "y", id="two")])
@pytest.mark.parametrize("engine", ["ddp", "mpi"])
def test_stacked(a, b, engine): ...

@pytest.mark.parametrize("x", CASES)
def test_computed(x): ...

class TestGroup:
    def test_in_class(self): ...
'''


def test_the_resolver_finds_what_exists_and_says_what_does_not(tmp_path: Path) -> None:
    """The existence check below can fail: a missing function, case or class is named, and a case list computed at
    collection is refused rather than taken on trust."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_sample.py").write_text(SAMPLE)
    def res(nodeid: str) -> Optional[str]:
        return resolve(f"tests/test_sample.py::{nodeid}", tmp_path)
    for good in ("test_plain[best]", "test_plain[best-outer]", "test_stacked[ddp-1-x]", "test_stacked[mpi-two]",
                 "TestGroup::test_in_class"):
        assert res(good) is None, (good, res(good))
    assert "no case 'worst'" in (res("test_plain[worst]") or "")
    assert "name one case" in (res("test_plain") or "")
    assert "no function test_gone" in (res("test_gone") or "")
    assert "not literals" in (res("test_computed[a]") or "")
    assert "not parametrized" in (res("TestGroup::test_in_class[x]") or "")
    assert "no class Missing" in (res("Missing::test_in_class") or "")
    assert "no file" in (resolve("tests/test_nowhere.py::test_x", tmp_path) or "")


def test_every_test_the_table_names_exists() -> None:
    """Each label a cell cites is in ``TESTS`` and each of ``TESTS`` is cited; each node id is a test of its file (and,
    where this run collected that file, one pytest collected)."""
    cited = {t for r in fd.ROWS for c in r.cells.values() for t in c.tests}
    assert cited == set(fd.TESTS), f"cited but not in TESTS: {sorted(cited - set(fd.TESTS))}; " \
                                   f"in TESTS, never cited: {sorted(set(fd.TESTS) - cited)}"
    missing = [why for why in map(resolve, fd.TESTS.values()) if why is not None]
    assert not missing, "\n".join(missing)
    collected = {i["nodeid"] for i in TIER_REPORT}
    files = {n.split("::")[0] for n in collected}
    absent = [n for n in fd.TESTS.values() if n.split("::")[0] in files and n not in collected]
    assert not absent, f"not collected by pytest: {absent}"


def test_no_cell_claims_a_result_without_a_test() -> None:
    """A claim (identical, Δ ≤ 1e-6, runs, the reference, a refusal) cites a test; "untested" and "not offered" cite none; "not
    offered" stands exactly where the bridge does not take the engine in that mode (unless the cell is that engine's
    refusal), and no result but a refusal is claimed there; a refusal's phrases are string text of each file citing
    it. Every row is one (front door, idiom, mode), every engine has its cell, and no text breaks the table (``|``)."""
    seen: set[tuple[str, str, str]] = set()
    bad: list[str] = []
    for r in fd.ROWS:
        key = (r.door, r.idiom, r.mode)
        assert key not in seen, f"row twice: {key}"
        seen.add(key)
        assert tuple(r.cells) == fd.ENGINES, key
        assert not any("|" in text for text in (r.door, r.idiom, r.compared_with)), key
        for engine, cell in r.cells.items():
            where = f"{r.door} / {r.idiom} / {r.mode} / {engine}: {cell.shown()}"
            offered = (engine, r.mode) in fd.OFFERED[r.door]
            if cell.result in fd.CLAIMS and not cell.tests:
                bad.append(f"{where}: a claim without a test")
            if cell.result not in fd.CLAIMS and (cell.tests or cell.result not in (fd.UNTESTED, fd.NOT_OFFERED)):
                bad.append(f"{where}: not a result of the table's vocabulary, or a test cited for no claim")
            if (cell.result == fd.NOT_OFFERED) == offered and cell.result != fd.REFUSED:
                bad.append(f"{where}: OFFERED says the bridge {'takes' if offered else 'does not take'} it")
            if cell.result in (fd.IDENTICAL, fd.CLOSE, fd.RUNS, fd.REFERENCE) and not offered:
                bad.append(f"{where}: a result claimed where the bridge does not take the engine")
            if (cell.result == fd.REFUSED) != bool(cell.phrases) or "|" in "".join(cell.phrases):
                bad.append(f"{where}: a refusal shows its phrases, and only a refusal")
            for label in cell.tests:
                path = ROOT / fd.TESTS.get(label, "?::").split("::")[0]
                texts = _strings(path) if path.is_file() else []
                bad += [f"{where}: {p!r} is no text of {path.name}" for p in cell.phrases
                        if not any(p in t for t in texts)]
    assert not bad, "\n".join(bad)
    for door, pairs in fd.OFFERED.items():  # every mode a bridge takes has its rows, and every bridge its engine row
        assert {m for _, m in pairs} == {r.mode for r in fd.ROWS if r.door == door}, door
        assert any(r.idiom.startswith("engine choice") for r in fd.ROWS if r.door == door), door


def test_integrations_md_shows_the_table_front_doors_py_proves() -> None:
    """docs/integrations.md holds the rendered table verbatim, under its heading, in the section right after the
    engines' section."""
    doc = (ROOT / "docs" / "integrations.md").read_text()
    table = fd.render_table()
    assert table in doc, "docs/integrations.md's front-door table differs from tests/front_doors.py; paste:\n" + table
    assert doc.count(HEADING) == 1 and doc.count("| front door | idiom |") == 1
    sections = [s.split("\n", 1)[0] for s in ("\n" + doc).split("\n## ")[1:]]
    assert sections[sections.index(AFTER[3:]) + 1] == HEADING[3:], sections
    section = doc.split(HEADING, 1)[1].split("\n## ", 1)[0]
    assert table in section


def test_each_front_door_claims_something() -> None:
    """No bridge's rows are all "untested": each has a result asserted against a reference."""
    for door in fd.DOORS:
        cells = [c for r in fd.ROWS if r.door == door for c in r.cells.values()]
        assert any(c.result in (fd.IDENTICAL, fd.CLOSE) for c in cells), door
