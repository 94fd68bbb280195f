"""distkit.launch.lazy_import: a deferred module runs its code on first use, exactly once, and behaves as imported."""
from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Iterator

import pytest

from distkit.launch import lazy_import


@pytest.fixture
def pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real package on sys.path whose import counts itself and has a submodule."""
    name = f"deferred_pkg_{tmp_path.name.replace('-', '_')}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("import builtins\nbuiltins.DEFERRED_RUNS = getattr(builtins, 'DEFERRED_RUNS', 0) + 1\n"
                                      "VALUE = 42\n")
    (root / "sub.py").write_text(f"from {name} import VALUE\nDOUBLE = 2 * VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import builtins

    builtins.DEFERRED_RUNS = 0  # type: ignore[attr-defined]
    yield name
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]
    del builtins.DEFERRED_RUNS  # type: ignore[attr-defined]


def runs() -> int:
    import builtins

    return int(builtins.DEFERRED_RUNS)  # type: ignore[attr-defined]


def test_an_import_statement_and_a_module_scan_do_not_run_it_first_use_runs_it_once(pkg: str) -> None:
    lazy_import.defer(pkg)
    mod = __import__(pkg)  # what "import mlflow" inside a library does
    assert runs() == 0 and isinstance(mod, type(sys))
    inspect.getmodule(test_an_import_statement_and_a_module_scan_do_not_run_it_first_use_runs_it_once)  # scans all
    assert runs() == 0 and mod.__name__ == pkg and mod.__file__.endswith("__init__.py")
    assert mod.VALUE == 42 and runs() == 1
    assert type(mod) is type(sys)  # a plain module from then on
    assert __import__(pkg).VALUE == 42 and runs() == 1


def test_a_submodule_imported_first_runs_the_package_before_it(pkg: str) -> None:
    lazy_import.defer(pkg)
    sub = __import__(f"{pkg}.sub", fromlist=["DOUBLE"])
    assert sub.DOUBLE == 84 and runs() == 1


def test_a_module_already_imported_or_missing_is_left_alone(pkg: str) -> None:
    mod = __import__(pkg)
    lazy_import.defer(pkg)
    assert sys.modules[pkg] is mod and runs() == 1
    lazy_import.defer("no_such_module_anywhere")
    assert "no_such_module_anywhere" not in sys.modules


def test_code_that_fails_leaves_it_unimported_as_a_plain_import_would(pkg: str, tmp_path: Path) -> None:
    (tmp_path / pkg / "__init__.py").write_text("raise ValueError('broken at import')\n")
    lazy_import.defer(pkg)
    mod = sys.modules[pkg]
    with pytest.raises(ValueError, match="broken at import"):
        mod.VALUE
    assert pkg not in sys.modules


#: a process that defers torch._dynamo, trains eagerly (AdamW, a scheduler, a state_dict round trip, a gloo process
#: group), then compiles: prints the parameters' checksum, whether dynamo was loaded before the compile, and whether
#: zero_grad runs dynamo's real "disabled" wrapper afterwards
DYNAMO_PROBE = """\
import hashlib, os, sys, tempfile, torch
import torch.distributed as dist
from distkit.launch import lazy_import
if sys.argv[1] == "defer":
    lazy_import.defer_dynamo()
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1), rank=0, world_size=1)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = torch.optim.AdamW(m.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
for _ in range(3):
    opt.zero_grad()
    m(torch.randn(3, 4)).square().sum().backward()
    opt.step()
    sched.step()
opt.load_state_dict(opt.state_dict())
loaded = type(sys.modules["torch._dynamo"]).__name__ != "_Deferred"
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in m.parameters())).hexdigest()
out = torch.compile(m, backend="eager")(torch.randn(2, 4))
opt.zero_grad()
fn = torch.optim.Optimizer.zero_grad.__wrapped__
print(digest, loaded, type(sys.modules["torch._dynamo"]).__name__, vars(fn)["__dynamo_disable"] is not fn, tuple(out.shape))
"""


def test_a_deferred_dynamo_trains_the_same_loads_on_compile_and_disables_for_real_then() -> None:
    """distkit.launch.lazy_import.defer_dynamo (every Session; the spawner): eager training (steps, zero_grad, a scheduler,
    state_dict, init_process_group) never loads torch._dynamo and gives the same parameters as a plain process;
    torch.compile loads it, and the optimizer methods marked as already disabled get dynamo's real wrapper."""
    import subprocess

    got = {how: subprocess.run([sys.executable, "-c", DYNAMO_PROBE, how], capture_output=True, text=True, timeout=120)
           for how in ("defer", "plain")}
    for how, res in got.items():
        assert res.returncode == 0, (how, res.stderr[-3000:])
    deferred, plain = (got[h].stdout.split() for h in ("defer", "plain"))
    assert deferred[0] == plain[0] and len(deferred[0]) == 64  # bit-identical parameters
    assert deferred[1:] == ["False", "module", "True", "(2,", "2)"], deferred
    assert plain[1:3] == ["True", "module"], plain
