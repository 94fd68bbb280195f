"""The two test tiers (issue 34): ``make check`` runs the fast one (``-m "not full"``), ``make test`` both.

A test's tier follows from what it starts, read from its code and the code of every fixture it requests
(following the functions and classes of ``tests/`` they use, transitively), not from a list of test names.
It is **full** when that code

- reaches a helper declared with :func:`full_tier` where it is defined (``tests/hosts.py``'s ``Hosts``:
  network-namespace hosts; ``tests/slurm.py``'s ``Slurm``: SLURM daemons; the ``lighthouse`` fixture and
  ``lighthouse_cmd``: a torchft lighthouse), so a new test that builds hosts lands there without anyone deciding;
- or starts processes (a helper declared with :func:`starts_processes`, or ``Popen``/``run_ranks``) and names
  kill trials, an injected fault, a signal, a wait for a timeout, a resume, a launcher other than ``--nprocs``
  or more than 2 ranks (:data:`FULL_FRAGMENTS`, :data:`FULL_EXACT`, :data:`FULL_NAMES`, :data:`RANK_OPTIONS`);
- or is a case of an engine sweep beyond DDP that is no parity case (:data:`SWEEP`);
- or carries ``pytest.mark.full("why")``, by hand, where no name carries the cost (the reason is required).

Everything else is **fast**: every test that starts no process, and single 2-rank runs. ``tests/test_tiers.py``
checks the rules on samples, and that the fast tier keeps a parity case of every engine and mode
(``pytest.mark.parity(engine, mode)``: the conformance suite's core rows), naming the one that lost it.
Full-tier tests with a reason outside :data:`PARALLEL_SAFE` are also ``serial``: ``make test`` runs them alone. Among
those reasons: an assertion on how long a started run took (:data:`TIMED`: an ``assert`` on ``clock() - t0``).
"""
from __future__ import annotations

import ast
import dis
import functools
import importlib
import inspect
import re
import textwrap
import types
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

TESTS = Path(__file__).resolve().parent
ATTR = "__distkit_tier__"
STARTS = "__distkit_starts__"
# Below: what makes a test that starts processes (through a launch helper marked :func:`starts_processes`, or
# ``Popen``/``run_ranks`` in its own code) a full-tier test. Its code, its module's helpers and the module's
# string globals they use (script texts, argument lists) are read for:
#: fragments of a string constant -> why
FULL_FRAGMENTS: dict[str, str] = {
    "kill_trials.py": "kill trials (benchmarks/kill_trials.py)",
    "DISTKIT_FAULT": "a fault injected into a run (DISTKIT_FAULT)",
    "++resume": "a second run that resumes the first",
    "++distributed.timeout_s": "a run that waits for a timeout (timeout_s)",
    "timeout_s':": "a run that waits for a timeout (timeout_s)",
    'timeout_s":': "a run that waits for a timeout (timeout_s)",
}
#: a whole string constant (also a test's parameter) -> why
SIGNAL = "a signal sent to a running job"
SIGNALS = ("SIGKILL", "SIGSTOP", "SIGTERM", "SIGUSR1", "SIGINT", "SIGCONT")
LAUNCHER = "a launcher other than --nprocs (torchrun, mpirun, horovodrun, deepspeed's, srun)"
FULL_EXACT: dict[str, str] = {
    "timeout_s": "a run that waits for a timeout (timeout_s)",
    **dict.fromkeys(SIGNALS, SIGNAL),
    # the launcher matrix: every row runs in the full tier (a path ending in /NAME counts too)
    **dict.fromkeys(("torchrun", "mpirun", "mpiexec", "horovodrun", "srun", "sbatch", "torch.distributed.launch",
                     "--num_gpus", "--num_accelerators", "--hostfile", "--no_ssh"), LAUNCHER),
}
#: an option followed by a rank count above 2 (the fast tier's runs have 2 ranks) -> why
RANK_OPTIONS = ("--nprocs", "--nproc_per_node", "--nproc-per-node", "-np", "-n", "--num_gpus", "--num_accelerators")
MORE_RANKS = "a run of more than 2 ranks"
RANK_KEYWORDS = ("nprocs", "world_size", "nproc_per_node")
#: a clock read by that code, subtracted from another and asserted on: it times what it observes -> why
TIMED = "an assertion on how long a started run takes"
CLOCKS = ("monotonic", "perf_counter", "time")
#: names used by that code -> why
FULL_NAMES: dict[str, str] = dict.fromkeys(SIGNALS, SIGNAL)
#: names that start processes when a test's own code uses them
STARTS_NAMES = ("Popen", "run_ranks", "check_output", "check_call")
#: a parametrized case whose id starts with another engine than DDP (the reference: ``[mpi-grad]``, ``[zero2]``),
#: unless it is a parity case (``pytest.mark.parity``): an engine sweep, whose DDP case stays in the fast tier
SWEEP = "an engine sweep beyond DDP (its DDP case is in the fast tier)"
OTHER_ENGINES = re.compile(r"mpi|horovod|hvd|deepspeed|zero\d?|z\d|fsdp")
#: a case of a test parametrized over one of these whose value is not the first one listed (the first is the
#: reference: DDP, ZeRO stage 0...): a sweep too
SWEPT = ("engine", "stage")
#: infrastructure whose code is followed only for :func:`full_tier` and :func:`starts_processes` marks (its
#: cleanup kills, its environment drops DISTKIT_FAULT: what every test uses says nothing of one test's cost)
INFRASTRUCTURE = ("conftest.py", "tiers.py")

T = TypeVar("T")


def full_tier(reason: str) -> Callable[[T], T]:
    """Declare that using the decorated helper (function, class, fixture function) puts a test in the full
    tier, with ``reason`` (what it starts, in a few words). Apply it under ``@pytest.fixture``."""
    def mark(obj: T) -> T:
        setattr(obj, ATTR, reason)
        return obj
    return mark


def starts_processes(fn: T) -> T:
    """Declare a launch helper: a test that calls it starts processes (the rules above then apply)."""
    setattr(fn, STARTS, True)
    return fn


def _strings(value: Any, depth: int = 0) -> Iterable[str]:
    """The strings in a parameter or constant (lists, tuples, sets, dicts of them, three levels deep)."""
    if isinstance(value, str):
        yield value
    elif depth < 3 and isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            yield from _strings(v, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k, depth + 1)
            yield from _strings(v, depth + 1)


def _is_clock(node: ast.AST) -> bool:
    """``time.monotonic()``, ``time.perf_counter()``, ``time.time()`` (or the bare names imported)."""
    if not isinstance(node, ast.Call) or node.args:
        return False
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr in CLOCKS and isinstance(f.value, ast.Name)
            and f.value.id == "time") or (isinstance(f, ast.Name) and f.id in CLOCKS[:2])


@functools.lru_cache(maxsize=None)
def _asserts_elapsed(fn: Any) -> bool:
    """Whether ``fn`` asserts on a time difference: an ``assert`` whose expression holds ``clock() - x`` or a
    name assigned from one (``took = time.monotonic() - t0``). A deadline (``clock() + 120``) is no timing."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False

    def pairs() -> Iterable[tuple[str, ast.AST]]:
        """(name, value) of every assignment, tuples unpacked (``elapsed, ended = clock() - t0, clock()``)."""
        for n in ast.walk(tree):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                n, (ast.AugAssign, ast.AnnAssign)) and n.value is not None else []
            for t in targets:
                if isinstance(t, ast.Name):
                    yield t.id, n.value  # type: ignore[misc]
                elif isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple) and len(t.elts) == len(n.value.elts):
                    yield from ((e.id, v) for e, v in zip(t.elts, n.value.elts) if isinstance(e, ast.Name))

    clocks = {name for name, value in pairs() if _is_clock(value)}  # ended = time.time()

    def elapsed(node: ast.AST) -> bool:
        return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) and (
            _is_clock(n.left) or isinstance(n.left, ast.Name) and n.left.id in clocks) for n in ast.walk(node))
    timed = {name for name, value in pairs() if elapsed(value)}
    return any(isinstance(n, ast.Assert) and (elapsed(n.test) or any(
        isinstance(m, ast.Name) and m.id in timed for m in ast.walk(n.test))) for n in ast.walk(tree))


@functools.lru_cache(maxsize=None)
def _keyword_ranks(fn: Any) -> int:
    """The largest rank count a call in ``fn``'s source passes as a keyword (``nprocs=4``), 0 if none."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return 0
    counts = [k.value.value for k in ast.walk(tree) if isinstance(k, ast.keyword) and k.arg in RANK_KEYWORDS
              and isinstance(k.value, ast.Constant) and isinstance(k.value.value, int)]
    return max(counts, default=0)


def _code_objects(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _ours(obj: Any) -> bool:
    """A function or class defined in ``tests/`` (followed further; torch's and distkit's are not)."""
    try:
        path = inspect.getsourcefile(inspect.unwrap(obj) if callable(obj) else obj)
    except TypeError:
        return False
    return path is not None and _in_tests(path)


@functools.lru_cache(maxsize=None)
def _imported_test_modules(code: types.CodeType) -> tuple[types.ModuleType, ...]:
    """The modules of ``tests/`` that ``code`` imports itself (an ``import`` statement inside a function)."""
    names = {ins.argval.partition(".")[0] for ins in dis.get_instructions(code) if ins.opname == "IMPORT_NAME"}
    return tuple(importlib.import_module(n) for n in sorted(names) if (TESTS / f"{n}.py").is_file())


@functools.lru_cache(maxsize=None)
def _in_tests(path: str) -> bool:
    """Whether the file ``path`` is in ``tests/`` (cached: every module global of every test is asked about, 110,000
    resolves of a few hundred paths, 6 of the 8 s a worker's collection took)."""
    return Path(path).resolve().parent == TESTS


def _functions_of(obj: Any) -> list[Callable[..., Any]]:
    if isinstance(obj, type):
        out = []
        for f in vars(obj).values():
            if isinstance(f, property):
                f = f.fget
            elif isinstance(f, (staticmethod, classmethod)):
                f = f.__func__
            if isinstance(f, types.FunctionType):
                out.append(f)
        return out
    raw = inspect.unwrap(obj) if callable(obj) else obj
    return [raw] if isinstance(raw, types.FunctionType) else []


class _Scan:
    """What the code reached from some functions starts: full-tier marks, whether it starts processes, and what
    its strings and names say (only counted for code that starts processes)."""

    def __init__(self) -> None:
        self.marked: set[str] = set()
        self.hints: set[str] = set()
        self.starts = False

    def strings(self, values: Iterable[str], fragments: bool = True) -> None:
        for text in values:
            if fragments:
                self.hints.update(why for frag, why in FULL_FRAGMENTS.items() if frag in text)
            why = FULL_EXACT.get(text) or FULL_EXACT.get(text.rsplit("/", 1)[-1])
            if why is not None and (fragments or why in (LAUNCHER, SIGNAL)):
                self.hints.add(why)

    def sequence(self, values: Any) -> None:
        """An argument list: an option of :data:`RANK_OPTIONS` followed by a count above 2."""
        if isinstance(values, (tuple, list)):
            for opt, count in zip(values, values[1:]):
                if opt in RANK_OPTIONS and isinstance(count, str) and count.isdigit() and int(count) > 2:
                    self.hints.add(MORE_RANKS)
            for v in values:
                self.sequence(v)

    def reasons(self) -> set[str]:
        return self.marked | (self.hints if self.starts else set())


def _scan(functions: Iterable[Any], scan: _Scan) -> _Scan:
    """Follow the global names each function uses into other functions and classes of ``tests/`` (attribute
    names are looked up on the test modules it uses: ``nethosts.Hosts``), collecting into ``scan``."""
    seen: set[int] = set()
    todo = list(functions)
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(getattr(obj, ATTR, None), str):
            scan.marked.add(getattr(obj, ATTR))
        scan.starts |= getattr(obj, STARTS, False) is True
        for fn in _functions_of(obj):  # (its marks, where it is a function, were read above)
            g = fn.__globals__
            # conftest's own code is followed for marks only: its cleanup kills, its environment drops
            # DISTKIT_FAULT; what every test uses says nothing of one test's cost
            ours = Path(fn.__code__.co_filename).name not in INFRASTRUCTURE
            modules = [m for m in g.values() if isinstance(m, types.ModuleType) and _ours(m)]
            # and those it imports inside itself ("import hosts as nethosts" in a test: fc16 ran such a test, which
            # builds hosts, beside the hosts tests, whose start removed its namespaces)
            modules += [m for code in _code_objects(fn.__code__) for m in _imported_test_modules(code) if m not in modules]
            if ours and _keyword_ranks(fn) > 2:
                scan.hints.add(MORE_RANKS)
            if ours and _asserts_elapsed(fn):
                scan.hints.add(TIMED)
            for code in _code_objects(fn.__code__):
                consts = code.co_consts[1:] if code is fn.__code__ and fn.__doc__ else code.co_consts  # not the docstring
                for name in code.co_names:
                    if ours and name in FULL_NAMES:
                        scan.hints.add(FULL_NAMES[name])
                    if ours and name in STARTS_NAMES:
                        scan.starts = True
                    targets = [g[name]] if name in g else []
                    targets += [getattr(m, name) for m in modules if hasattr(m, name)]
                    for target in targets:
                        if ours and isinstance(target, (str, list, tuple, dict)):
                            scan.strings(_strings(target))  # a script text or argument list of the module
                            scan.sequence(target)
                        elif (isinstance(target, (types.FunctionType, type)) or hasattr(target, "__wrapped__")) \
                                and _ours(target):
                            todo.append(target)
                        elif isinstance(getattr(target, ATTR, None), str) or getattr(target, STARTS, False) is True:
                            todo.append(target)
                if ours:
                    scan.strings(_strings(tuple(c for c in consts if isinstance(c, (str, tuple, frozenset)))))
                    scan.sequence(tuple(consts))  # ("--nprocs", "4") in a call's arguments are neighbours here
    return scan


def reasons(functions: Iterable[Any]) -> set[str]:
    """Why code reached from ``functions`` is full-tier; empty: fast."""
    return _scan(functions, _Scan()).reasons()


def fixture_functions(item: Any) -> list[Any]:
    """The functions of every fixture ``item`` requests (transitively: pytest's closure)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [d.func for defs in info.name2fixturedefs.values() for d in defs]


#: full-tier reasons that a test can share the machine with another test for (make test runs those tests on two
#: workers): what they check is a result (parameters, a checkpoint, a message), not how long it took. Any other
#: reason (hosts, SLURM daemons, a lighthouse, kill trials, a wait for a timeout, an assertion on elapsed time,
#: a reason given by hand: tests that time what they observe or use machine-wide names) makes a test ``serial``:
#: make test runs those one at a time
PARALLEL_SAFE = frozenset({LAUNCHER, MORE_RANKS, SWEEP, FULL_FRAGMENTS["++resume"], FULL_FRAGMENTS["DISTKIT_FAULT"],
                           SIGNAL})


#: full-tier reasons that take a machine-wide name (network namespaces and their hostnames, the SLURM cluster):
#: the serial tests with one of them run one at a time among themselves, beside the other serial tests
MACHINE_WIDE = frozenset({"network-namespace hosts", "SLURM daemons"})


def serial(why: Iterable[str]) -> bool:
    """Whether a full-tier test with these reasons runs alone (see :data:`PARALLEL_SAFE`)."""
    return any(r not in PARALLEL_SAFE for r in why)


def _first_of_sweep(item: Any, params: dict[str, Any]) -> bool:
    """False where a parameter of :data:`SWEPT` has another value than the first its ``parametrize`` lists."""
    for mark in item.iter_markers("parametrize"):
        names = [n.strip() for n in mark.args[0].split(",")] if isinstance(mark.args[0], str) else list(mark.args[0])
        values = list(mark.args[1]) if len(mark.args) > 1 else []
        for k, name in enumerate(names):
            if name in SWEPT and name in params and values:
                first = values[0].values if hasattr(values[0], "values") else values[0]
                first = first[k] if len(names) > 1 else first
                if name == "engine" and not OTHER_ENGINES.search(str(params[name])):
                    continue  # DDP's case: the reference, wherever it is listed
                if params[name] != first:
                    return False
    return True


@functools.lru_cache(maxsize=None)
def _scanned(functions: tuple[Any, ...]) -> tuple[frozenset[str], frozenset[str], bool]:
    """:func:`_scan` of a test function with its fixtures, once per set: the cases of a parametrized test share it
    (collection ran it 730 times for about 300 sets, in every xdist worker)."""
    scan = _scan(functions, _Scan())
    return frozenset(scan.marked), frozenset(scan.hints), scan.starts


def tier_of(item: Any) -> tuple[str, list[str]]:
    """``("full", reasons)`` or ``("fast", [])`` for a collected test item."""
    why = set()
    for mark in item.iter_markers("full"):
        assert mark.args and isinstance(mark.args[0], str), f"{item.nodeid}: pytest.mark.full needs a reason"
        why.add(mark.args[0])
    marked, hints, starts = _scanned((getattr(item, "function", None), *fixture_functions(item)))
    scan = _Scan()  # (a fresh one: the parameters below add to it)
    scan.marked |= marked
    scan.hints |= hints
    scan.starts = starts
    spec = getattr(item, "callspec", None)
    if spec is not None:  # a parameter names a launcher or a signal (not a config text's words)
        scan.strings(_strings(list(spec.params.values())), fragments=False)
        if scan.starts and not any(item.iter_markers("parity")) and (
                OTHER_ENGINES.fullmatch(spec.id.split("-")[0]) or not _first_of_sweep(item, spec.params)):
            why.add(SWEEP)
    why |= scan.reasons()
    return ("full", sorted(why)) if why else ("fast", [])
