"""DDP end to end under every launcher, as real processes (DESIGN.md sections 5 and 8).

One small RETURNN-style config runs under distkit's own spawner (``--nprocs 2`` and
perceptrain's ``nprocs = 2`` key), torchrun, the old ``torch.distributed.launch`` (which
passes ``--local-rank=N`` as an argument) and Open MPI's ``mpirun``, where the user exports
nothing but the command. Each run must report the launcher it really had, two ranks in
sync, and the same final parameters, bit for bit: the launcher must not change the result.

distkit's spawner forks its ranks from the launching process (:mod:`distkit.launch.forkrank`, the ``spawn``
run), or starts new interpreters where the config imports a module of the user's own code (the
``nprocs_key`` run): either way each rank must see its own environment, and torch its own thread
count, where the config's code (and the user's module) runs.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import BIN, distkit, ok, run, summary

from distkit.launch.spawner import free_port

STEPS = 12

CONFIG = """\
task = "digits"
torch_distributed = {{}}
max_steps = {steps}
batch_size = 16
progress_bar = False
output_dir = {out!r}
{extra}"""


#: config code that records, where it runs (the launcher, then every rank), the rank it sees, torch's
#: thread count and whether the process was exec'd (a new interpreter's own environment block names
#: RANK; a fork's is the launcher's)
PROBE = """\
import json, os, torch
with open("/proc/self/environ", "rb") as _f:
    _exec_started = b"\\0RANK=" in b"\\0" + _f.read()
with open(os.path.join(os.path.dirname(__file__), "probe-%s.json" % os.environ.get("RANK", "launcher")), "w") as _f:
    json.dump({"rank": os.environ.get("RANK"), "threads": torch.get_num_threads(), "exec": _exec_started}, _f)
"""
# (underscored names: the config loader takes every other plain name in a config file for a key)


def write_config(path: Path, out: Path, extra: str = "") -> Path:
    path.write_text(CONFIG.format(steps=STEPS, out=str(out), extra=extra))
    return path


def probe_config(path: Path, out: Path, user_module: bool, extra: str = "") -> Path:
    """:func:`write_config` in its own directory with :data:`PROBE`: in the config itself, or in a
    module of the user's own code (``user_probe.py`` beside it) that the config imports."""
    path.parent.mkdir()
    if not user_module:
        return write_config(path, out, PROBE + extra)
    (path.parent / "user_probe.py").write_text(PROBE)
    return write_config(path, out, f"import sys\nsys.path.insert(0, {str(path.parent)!r})\nimport user_probe\n{extra}")


def _command(launcher: str, cfg: Path) -> list[str]:
    py = sys.executable
    train = ["-m", "distkit", "train", str(cfg)]
    if launcher == "spawn":
        return [py, *train, "--nprocs", "2"]
    if launcher == "nprocs_key":  # perceptrain: nprocs in the config, no flag
        return [py, *train]
    if launcher == "torchrun":  # --standalone: c10d rendezvous on a free port
        return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", *train]
    if launcher == "torch_launch":  # deprecated launcher: passes --local-rank=N to the module
        return [py, "-m", "torch.distributed.launch", "--nproc_per_node", "2", "--master_port", str(free_port()),
                *train]
    if launcher == "mpirun":  # no MASTER_ADDR/PORT exported: distkit must find the rendezvous itself
        return [str(BIN / "mpirun"), "--oversubscribe", "-np", "2", py, *train]
    raise AssertionError(launcher)


#: launcher under test -> the ``launcher`` summary.json must report
EXPECTED = {"spawn": "spawn", "nprocs_key": "spawn", "torchrun": "torchrun", "torch_launch": "torchrun",
            "mpirun": "openmpi"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    """Run the same config once under every launcher; {launcher: (result, output_dir)}."""
    root = tmp_path_factory.mktemp("launchers")
    results = {}
    for launcher in EXPECTED:
        out = root / f"out-{launcher}"
        if launcher in ("spawn", "nprocs_key"):  # the launcher's torch has every core (no OMP_NUM_THREADS)
            cfg = probe_config(root / launcher / "cfg.py", out, user_module=launcher == "nprocs_key",
                               extra="nprocs = 2\n" if launcher == "nprocs_key" else "")
            results[launcher] = (run(_command(launcher, cfg), timeout=120, OMP_NUM_THREADS=""), out)
        else:
            cfg = write_config(root / f"cfg_{launcher}.py", out)
            results[launcher] = (run(_command(launcher, cfg), timeout=120), out)
    return results


@pytest.mark.parametrize("launcher", list(EXPECTED))
def test_ddp_under_launcher(runs: dict[str, Any], launcher: str) -> None:
    res, out = runs[launcher]
    ok(res)
    s = summary(out)
    assert s["world_size"] == 2, s
    assert s["launcher"] == EXPECTED[launcher], s
    assert s["backend"] == "ddp" and s["reduce_type"] == "grad", s
    assert s["ranks_in_sync"] is True, s
    assert s["steps"] == STEPS, s
    assert s["samples"] == STEPS * 16 * 2, s


def test_same_params_under_every_launcher(runs: dict[str, Any]) -> None:
    """Same config and seed: bit-identical parameters whichever launcher started the ranks."""
    checksums = {}
    for launcher, (res, out) in runs.items():
        ok(res)
        checksums[launcher] = summary(out)["param_checksum"]
    assert len(set(checksums.values())) == 1, checksums
    assert len(checksums["spawn"]) == 64, checksums  # a sha256 hex digest, not an empty placeholder


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_fsdp_under_launcher_gives_ddps_params(runs: dict[str, Any], launcher: str, tmp_path: Path) -> None:
    """The fsdp engine (issue 38) under torchrun and mpirun, picked with ``++distributed.backend fsdp`` on the
    command line: the launcher it had, and ddp's parameters bit for bit (2 ranks: a mean of two is one rounding)."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "cfg.py", out)
    ok(run(_command(launcher, cfg) + ["++distributed.backend", "fsdp"], timeout=120))
    s = summary(out)
    assert (s["backend"], s["launcher"], s["world_size"], s["steps"], s["ranks_in_sync"]) == \
        ("fsdp", EXPECTED[launcher], 2, STEPS, True), s
    assert s["param_checksum"] == summary(runs["spawn"][1])["param_checksum"]


@pytest.mark.parametrize("launcher,forked", [("spawn", True), ("nprocs_key", False)])
def test_spawned_ranks_run_the_config_with_their_own_environment(runs: dict[str, Any], launcher: str,
                                                                    forked: bool) -> None:
    """Forked (config code only) or new interpreters (the config imports the user's own module),
    each rank runs the config's code with its own RANK and torch on its share of the cores (2 cores
    / 2 ranks = 1 thread), not the launcher's."""
    import os

    ok(runs[launcher][0])
    root = runs[launcher][1].parent / launcher
    probes = {p.name: json.loads(p.read_text()) for p in root.glob("probe-*.json")}
    assert set(probes) == {"probe-launcher.json", "probe-0.json", "probe-1.json"}, probes  # the launcher ran it too
    cores = os.cpu_count() or 1
    assert probes["probe-launcher.json"]["threads"] == cores, probes
    for rank in ("0", "1"):
        p = probes[f"probe-{rank}.json"]
        assert p["rank"] == rank and p["exec"] is not forked, p
        assert p["threads"] == max(1, cores // 2), p


def test_torch_distributed_launch_passes_local_rank_argument(tmp_path: Path) -> None:
    """torch 2.13's deprecated launcher still inserts ``--local-rank=N`` before the script's arguments."""
    probe = tmp_path / "probe.py"
    probe.write_text("import sys; print('ARGV', sys.argv[1:])\n")
    res = ok(run([sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "1",
                  "--master_port", str(free_port()), str(probe), "train", "cfg.py"], timeout=60))
    assert "ARGV ['--local-rank=0', 'train', 'cfg.py']" in res.stdout, res.stdout


@pytest.mark.parametrize("flags", [["train", "{cfg}", "--local_rank", "0"],
                                   ["train", "{cfg}", "--local-rank", "0"],
                                   ["train", "{cfg}", "--local-rank=0"],
                                   ["--local-rank=0", "train", "{cfg}"]],  # torch.distributed.launch's order
                         ids=["local_rank", "local-rank", "local-rank=", "before-command"])
def test_local_rank_flags_accepted_single_process(tmp_path: Path, flags: list[str]) -> None:
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "cfg.py", out)
    from distkit.commands.cli import main

    code = main([f.format(cfg=cfg) for f in flags] + ["++max_steps", "3"])
    assert code == 0
    s = summary(out)
    assert (s["world_size"], s["launcher"], s["steps"]) == (1, "single", 3), s


def test_local_rank_flag_real_single_process(tmp_path: Path) -> None:
    """The same through the real command line, as a separate process."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "cfg.py", out)
    ok(distkit("train", str(cfg), "--local-rank", "0", "++max_steps", "3", timeout=60))
    s = summary(out)
    assert (s["world_size"], s["launcher"], s["steps"]) == (1, "single", 3), s



@pytest.mark.parametrize("engine,dynamo", [((), "_Deferred"), (("torch._dynamo",), "module")])
def test_what_the_launcher_imports_for_its_forked_ranks_leaves_it_able_to_fork(engine: tuple[str, ...],
                                                                               dynamo: str) -> None:
    """The spawner imports the engine's modules once before forking its ranks (distkit.launch.forkrank.preimport): DDP's
    grad mode lists torch._dynamo, which its constructor loads in every rank; the others leave it deferred
    (distkit.launch.lazy_import.defer_dynamo), and the forks inherit that. Neither may start a thread (a fork would copy
    only the calling one, and can_fork would send every rank to a new interpreter instead)."""
    probe = ("import sys, threading, torch; from distkit.launch import forkrank; assert 'torch._dynamo' not in sys.modules; "
             f"forkrank.preimport({engine!r}); "
             "print(type(sys.modules['torch._dynamo']).__name__, threading.active_count(), forkrank.can_fork())")
    res = ok(run([str(BIN / "python"), "-c", probe]))
    assert res.stdout.split() == [dynamo, "1", "True"], res.stdout


#: a user's script that calls distkit.init with nprocs 2, and records in each rank (init returns only there) what
#: it runs with: its rank, the environment, torch's thread count, whether the process was exec'd, its arguments and
#: module name, and how many times its first lines ran in this process (1: a fork runs the script again from its
#: first line in a fresh __main__, as a new interpreter does)
SCRIPT_PROBE = """\
import json, os, sys, torch
{own}import distkit
RUNS = globals().get("RUNS", 0) + 1
ARGS = sys.argv[1:]
with open("/proc/self/environ", "rb") as _f:
    exec_started = b"\\0RANK=" in b"\\0" + _f.read()
sys.argv = sys.argv[:1]  # nanoGPT's habit: the script strips its arguments before init (ranks get them again)
dk = distkit.init({{"nprocs": 2, "progress_bar": False}})
with open(os.path.join({where!r}, f"probe-{{dk.rank}}.json"), "w") as f:
    json.dump({{"rank": dk.rank, "env_rank": os.environ.get("RANK"), "threads": torch.get_num_threads(),
               "exec": exec_started, "name": __name__, "runs": RUNS, "args": ARGS}}, f)
"""


@pytest.mark.parametrize("form,forked", [("script", True), ("module", True), ("own_module", False)])
def test_a_scripts_ranks_are_forks_that_run_it_again_or_new_interpreters(tmp_path: Path, form: str,
                                                                        forked: bool) -> None:
    """``python train.py --nprocs 2`` (or ``python -m train``): each rank is a fork of the launching process that
    runs the script again from its first line with the rank's environment (torch imported once, not per rank),
    or a new interpreter where the script imported a module of the user's own (its import-time code ran in the
    launcher). Either way the rank sees its own RANK and thread count, the original arguments, and runs as
    ``__main__``."""
    import os

    own = "import helper  # the user's own module, beside the script\n" if form == "own_module" else ""
    (tmp_path / "train.py").write_text(SCRIPT_PROBE.format(own=own, where=str(tmp_path)))
    (tmp_path / "helper.py").write_text("VALUE = 1\n")
    cmd = [str(BIN / "python"), *(["-m", "train"] if form == "module" else [str(tmp_path / "train.py")]), "a", "b"]
    res = ok(run(cmd, cwd=tmp_path, timeout=120))
    probes = [json.loads((tmp_path / f"probe-{r}.json").read_text()) for r in range(2)]
    for r, p in enumerate(probes):
        assert (p["rank"], p["env_rank"], p["name"], p["runs"], p["args"]) == (r, str(r), "__main__", 1, ["a", "b"]), p
        assert p["exec"] is not forked, (p, res.stderr[-2000:])
        assert p["threads"] == max(1, (os.cpu_count() or 1) // 2), p
