"""``distkit env`` (issue 27 item 2): the report against this machine's real installs, and in a real venv without
Horovod (the same packages, Horovod left out), where it says why and how to fix it."""
from __future__ import annotations

import json
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from conftest import ROOT, base_env, distkit, ok, venv_without

ENGINES = {"ddp", "deepspeed", "mpi", "horovod", "fsdp"}


def _report(*args: str, **env: str) -> dict[str, Any]:
    res = ok(distkit("env", "--json", *args, **env))
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def test_the_report_names_this_machines_real_installs() -> None:
    r = _report("--rendezvous", "127.0.0.1")
    assert r["torch"]["version"] == torch.__version__ and r["torch"]["backends"]["gloo"] is True
    assert r["distkit"]["path"] == str(ROOT / "distkit")  # the package, wherever the command's module lies in it
    assert r["torch"]["cuda_available"] is torch.cuda.is_available() and r["gpus"]["count"] == torch.cuda.device_count()
    assert r["deepspeed"]["version"] == metadata.version("deepspeed") and r["deepspeed"]["accelerator"] == "cpu"
    assert r["deepspeed"]["ops"]["cpu_adam"]["compatible"] in (True, False) and len(r["deepspeed"]["ops"]) >= 5
    assert r["horovod"]["version"] == metadata.version("horovod") and r["horovod"]["torch"] is True
    assert r["horovod"]["controllers"] == {"mpi": True, "gloo": True}, r["horovod"]
    assert r["mpi"]["mpi4py"] == metadata.version("mpi4py") and r["mpi"]["library"].startswith("Open MPI v")
    assert r["mpi"]["mpirun"] == str(ROOT / ".venv" / "bin" / "mpirun") and "Open MPI" in r["mpi"]["mpirun_version"]
    assert r["engines"] == {name: {"runs": True} for name in ENGINES}, r["engines"]
    assert r["launcher"]["launcher"] == "single" and r["launcher"]["world_size"] == 1
    assert r["network"]["chosen"] == {"interface": "lo", "address": "127.0.0.1"}
    assert r["network"]["interfaces"]["lo"] == "127.0.0.1"
    # issue 36 item 19: the host by its name (the identity, which tells apart hosts that share one, beside it)
    assert r["network"]["host"] == socket.gethostname() and "|" not in r["network"]["host"]
    assert r["network"]["host_identity"].startswith(socket.gethostname())
    assert r["optional"]["torchft"] == metadata.version("torchft") and r["optional"]["matplotlib"] == metadata.version("matplotlib")
    assert set(r["optional"]) >= {"torchft", "tensorboard", "mlflow", "wandb", "matplotlib", "transformers", "accelerate"}


def test_the_launcher_section_reads_slurms_variables() -> None:
    # the environment handed to env.detect: what srun gives the second of two tasks
    r = _report(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1", SLURM_NNODES="1",
                SLURM_JOB_NODELIST="vm", SLURM_NODEID="0", SLURM_TASKS_PER_NODE="2", MASTER_ADDR="127.0.0.1")
    launcher = r["launcher"]
    assert (launcher["launcher"], launcher["rank"], launcher["world_size"], launcher["job_id"]) == ("slurm", 1, 2, "4242")
    assert launcher["variables"]["SLURM_PROCID"] == "1" and r["network"]["rendezvous"] == "127.0.0.1"


def test_the_text_report_has_every_section_and_one_line_per_deepspeed_op() -> None:
    text = ok(distkit("env")).stdout
    sections = [line[3:] for line in text.splitlines() if line.startswith("== ")]
    assert sections == ["distkit", "python", "torch", "deepspeed", "horovod", "mpi", "engines", "launcher", "network",
                        "gpus", "optional"]
    assert any(line.strip().startswith("cpu_adam: installed ") for line in text.splitlines())


def test_a_venv_without_horovod_says_why_and_how_to_fix_it(tmp_path: Path) -> None:
    # A real venv with this venv's packages (linked), Horovod left out: what a user who skipped `make horovod` has.
    python = venv_without(tmp_path, "horovod")
    env = base_env()
    env.pop("PYTHONPATH")  # distkit comes from the linked editable install, as in the user's venv
    res = subprocess.run([str(python), "-m", "distkit", "env", "--json"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout)
    assert r["horovod"]["installed"] is False and "No module named 'horovod'" in r["horovod"]["why"]
    assert r["horovod"]["fix"].startswith("make horovod")
    assert r["engines"]["horovod"]["runs"] is True  # use_horovod runs on distkit's mpi engine; the note says so
    assert "on distkit's mpi engine: horovod.torch does not import" in r["engines"]["horovod"]["note"]
    assert r["torch"]["version"] == torch.__version__ and r["engines"]["ddp"] == {"runs": True}
