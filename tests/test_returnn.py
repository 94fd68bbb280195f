"""distkit.integrations.returnn: RETURNN's own PyTorch engine (``python -m returnn cfg.py``) training on distkit's engines and modes.

Each parity case starts real RETURNN jobs of 2 ranks on the CPU at the same time, one on RETURNN's own path and one
per distkit engine, from the same config, seed and data (``dataset_distribution="shard"``: each rank trains on its own
sequences, so the ranks' gradients differ), and compares what RETURNN saves after each of 2 epochs (rank 0's model and
Adam's state: ``model.00N.pt``, ``model.00N.opt.pt``). The reference is RETURNN's ``DistributedDataParallel`` for grad
mode and RETURNN's ``reduce_type="param"`` (with ``sync_at_epoch_end``: parameters and optimizer state averaged at the
end of each epoch) for param mode. With 2 ranks both sides' mean of two numbers is exact ((a + b) / 2 and a / 2 + b / 2
are the same float), so they must agree bit for bit. Every rank also records, at the end of each epoch, a checksum of
its parameters and distkit's ``dk.summary()`` (which engine ran, its steps, the bytes it sent).

RETURNN's DDP on the CPU needs ``device = "cpu"`` and a gloo group (docs/returnn.md); the jobs run without data loader
processes (``torch_dataloader_opts``) so that each rank imports torch once. ``DISTKIT_RETURNN_DEVICE=cuda`` (what
``scripts/gpu_check.sh`` sets) runs the parity cases on CUDA instead: one rank per GPU (RETURNN puts rank r on
``cuda:r``), RETURNN's default NCCL group, within 1e-6.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import BIN, base_env

#: the config every job shares; each case puts OUT, torch_distributed and epoch_end in front of it
COMMON = r'''
import hashlib, json, os, sys
import torch
import returnn.frontend as rf
from returnn.tensor import batch_dim

backend = "torch"
device = DEVICE
task = "train"
behavior_version = 24
log_verbosity = 3
num_epochs = 2
batch_size = 200
max_seqs = 4
torch_dataloader_opts = {"num_workers": 0}
learning_rate = 0.05
optimizer = {"class": "adam"}
train = {"class": "Task12AXDataset", "num_seqs": 24, "fixed_random_seed": 1}
extern_data = {"data": {"dim": 9}, "classes": {"dim": 2, "sparse": True}}
model = OUT + "/model"


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(9, 16)
        self.out = torch.nn.Linear(16, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


def get_model(**_):
    torch.manual_seed(42)
    return Model()


def train_step(*, model, extern_data, **_):
    data = extern_data["data"]
    logits = model(data.raw_tensor)
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), extern_data["classes"].raw_tensor.long(),
                                             reduction="none")
    rf.get_run_ctx().mark_as_loss(name="ce", loss=loss, dims=[batch_dim, data.dims[1]])


def record(*, model, dataset_name, **_):
    """This rank's parameters' checksum and distkit's summary (collective), at the end of the epoch."""
    if dataset_name != "train":
        return
    rank = int(os.environ["RANK"])
    digest = hashlib.sha256()
    for _, p in model.named_parameters():
        digest.update(p.detach().float().contiguous().numpy().tobytes())
    out = {"rank": rank, "checksum": digest.hexdigest()}
    bridge = sys.modules.get("distkit.integrations.returnn")
    dk = bridge.session() if bridge is not None else None
    if dk is not None:
        s = dk.summary()
        out.update({k: s[k] for k in ("backend", "backend_impl", "reduce_type", "param_sync_step", "world_size",
                                      "steps", "ranks_in_sync", "comm_bytes")})
    with open(f"{OUT}/rank{rank}.json", "w") as f:
        json.dump(out, f)
'''
#: where the parity cases run: "cpu" (2 ranks, gloo), or "cuda" (scripts/gpu_check.sh; one rank per GPU: NCCL cannot
#: share a GPU between ranks, and RETURNN puts rank r on cuda:r)
DEVICE = os.environ.get("DISTKIT_RETURNN_DEVICE", "cpu")
RANKS = 2 if DEVICE == "cpu" else torch.cuda.device_count()
#: the largest difference allowed from RETURNN's own path: none on the CPU (see above); CUDA's kernels may differ
BOUND = 0.0 if DEVICE == "cpu" else 1e-6
#: RETURNN's own paths: DDP (grad), and param mode averaging every 2 steps and at the end of each epoch; on the CPU in a
#: gloo group (RETURNN's default "cpu:gloo,cuda:nccl" needs a torch with NCCL)
GLOO = '"backend": "gloo", ' if DEVICE == "cpu" else ""
RETURNN_GRAD = f'torch_distributed = {{{GLOO}"dataset_distribution": "shard"}}\nepoch_end = record\n'
RETURNN_PARAM = (f'torch_distributed = {{{GLOO}"dataset_distribution": "shard", "reduce_type": "param", '
                 '"param_sync_step": 2, "sync_at_epoch_end": True}\nepoch_end = record\n')
#: the same through distkit: the config lines docs/returnn.md gives
DISTKIT = ('import distkit.integrations.returnn\ntorch_distributed = distkit.integrations.returnn.torch_distributed({args}, '
           'dataset_distribution="shard")\nepoch_end = distkit.integrations.returnn.epoch_end_then(record)\n')
#: job -> launcher: torchrun's variables set by hand (RETURNN's own DDP reads them), or mpirun
LAUNCH = {"reference": "env", "ddp": "env", "mpi": "mpirun", "horovod": "mpirun"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(tmp_path: Path, name: str, head: str) -> tuple[Path, Path]:
    """``job_NAME.py`` (the working directory is on the jobs' sys.path: a config named horovod.py would be what
    ``import horovod`` finds) and its output directory."""
    out = tmp_path / name
    out.mkdir()
    cfg = tmp_path / f"job_{name}.py"
    cfg.write_text(f"OUT = {str(out)!r}\nDEVICE = {'cpu' if DEVICE == 'cpu' else 'gpu'!r}\n{COMMON}\n{head}")
    return cfg, out


def _start(cfg: Path, launcher: str, tmp_path: Path) -> list[subprocess.Popen[str]]:
    """The job's processes, their output in ``NAME.out.log`` (mpirun) or ``NAME.rankR.log``: :data:`RANKS` ranks with
    torchrun's variables, or one mpirun of as many."""
    returnn = [sys.executable, "-m", "returnn", str(cfg)]
    if launcher == "mpirun":
        cmd = [str(BIN / "mpirun"), "-np", str(RANKS), "--oversubscribe", "--bind-to", "none", *returnn]
        with open(cfg.with_suffix(".out.log"), "w") as log:
            return [subprocess.Popen(cmd, cwd=tmp_path, env=base_env(), stdout=log, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)]
    port, procs = str(_port()), []
    for r in range(RANKS):
        env = base_env(RANK=str(r), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(RANKS),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        with open(cfg.with_suffix(f".rank{r}.log"), "w") as log:
            procs.append(subprocess.Popen(returnn, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          text=True, start_new_session=True))
    return procs


def _run_jobs(tmp_path: Path, jobs: dict[str, tuple[str, str]], timeout: float = 170) -> dict[str, Path]:
    """Start every job at once (name -> (config head, launcher)), wait for all; their output directories."""
    outs, procs = {}, {}
    for name, (head, launcher) in jobs.items():
        cfg, outs[name] = _config(tmp_path, name, head)
        procs[name] = _start(cfg, launcher, tmp_path)
    failed = []
    try:
        for name, ps in procs.items():
            for p in ps:
                if p.wait(timeout=timeout) != 0:
                    failed.append(f"{name} exit {p.returncode}")
    finally:
        for ps in procs.values():
            for p in ps:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
    if failed:
        logs = "\n".join(f"== {f.name}\n{f.read_text()[-2500:]}" for f in sorted(tmp_path.glob("*.log")))
        raise AssertionError(f"{', '.join(failed)}\n{logs}")
    return outs


def _saved(out: Path, epoch: int) -> dict[str, torch.Tensor]:
    """The model and the optimizer state RETURNN saved after ``epoch`` (rank 0's), as one flat dict of tensors."""
    model = torch.load(out / f"model.{epoch:03d}.pt", map_location="cpu", weights_only=True)["model"]
    opt = torch.load(out / f"model.{epoch:03d}.opt.pt", map_location="cpu", weights_only=True)["optimizer"]
    state = {f"opt.{i}.{k}": v for i, s in opt["state"].items() for k, v in s.items() if torch.is_tensor(v)}
    assert state, "no optimizer state saved"
    return {**model, **state}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]


def _initial() -> dict[str, torch.Tensor]:
    scope: dict[str, Any] = {"OUT": "", "DEVICE": "cpu"}
    exec(COMMON.split("def train_step")[0], scope)  # the config's Model and get_model
    return {k: v.detach().clone() for k, v in scope["get_model"]().state_dict().items()}


def _train_losses(log: Path) -> list[str]:
    return [line.split(":")[-1].strip() for line in log.read_text().splitlines() if "Total train loss" in line]


def _steps(log: Path) -> int:
    """The optimizer steps RETURNN reported for the run ("Epoch N: Trained S steps", summed over the epochs)."""
    return sum(int(line.split("Trained ")[1].split()[0]) for line in log.read_text().splitlines()
               if ": Trained " in line)


#: RETURNN's gradient accumulation: 2 batches of 2 sequences per optimizer step (the config's later lines win)
ACCUM = "max_seqs = 2\naccum_grad_multiple_step = 2\n"
#: how far distkit's engines may be from RETURNN's own path, per case and engine (more than BOUND where noted)
ACCUM_BOUND = 1e-5


@pytest.mark.parametrize("case", ["grad", "grad+accum", "param+accum"])
def test_returnn_trains_on_each_engine_like_its_own_path(tmp_path: Path, case: str) -> None:
    """RETURNN's training loop through distkit's ddp, mpi and horovod engines equals RETURNN's own path, parameters
    and optimizer state after each epoch: grad mode against RETURNN's DDP, param mode (sync every 2 optimizer steps and
    at each epoch's end) against RETURNN's param mode, bit for bit. Except grad mode with accumulation on mpi and
    Horovod: RETURNN enters DDP's ``no_sync`` after the forward (returnn/torch/engine.py), when DDP has decided to
    reduce already, so its DDP (and distkit's ddp engine, the same DDP called the same way) all-reduces every
    micro-step's gradients, where the mpi and Horovod engines reduce each step's sum once: the same mean, rounded
    otherwise (about 1e-6 here)."""
    if RANKS < 1:
        pytest.fail(f"DISTKIT_RETURNN_DEVICE={DEVICE}: no CUDA device here (torch.cuda.device_count() is 0)")
    mode, accum = case.split("+")[0], 2 if case.endswith("+accum") else 1
    reference = (RETURNN_GRAD if mode == "grad" else RETURNN_PARAM) + (ACCUM if accum > 1 else "")
    extra = "" if mode == "grad" else ', reduce_type="param", param_sync_step=2'
    jobs = {"reference": (reference, LAUNCH["reference"])}
    jobs.update({e: (DISTKIT.format(args=f'backend="{e}"{extra}') + (ACCUM if accum > 1 else ""), LAUNCH[e])
                 for e in ("ddp", "mpi", "horovod")})
    outs = _run_jobs(tmp_path, jobs)

    refs = {epoch: _saved(outs["reference"], epoch) for epoch in (1, 2)}
    assert _max_diff({k: v for k, v in refs[2].items() if not k.startswith("opt.")}, _initial()) > 1e-2  # it trained
    ref_ranks = _records(outs["reference"])
    assert len({r["checksum"] for r in ref_ranks}) == 1  # RETURNN's ranks agree at the end of the last epoch
    batches = _steps(tmp_path / "job_reference.rank0.log")  # (every rank as many: RETURNN stops them together)
    assert batches >= 4 and batches % accum == 0
    if RANKS > 1:  # ... after training on different data: each rank printed the loss of its own sequences
        losses = [_train_losses(tmp_path / f"job_reference.rank{r}.log") for r in range(RANKS)]
        assert all(len(x) == 2 for x in losses) and len({tuple(x) for x in losses}) == RANKS
    for engine in ("ddp", "mpi", "horovod"):
        bound = ACCUM_BOUND if case == "grad+accum" and engine != "ddp" and RANKS > 1 else BOUND
        for epoch in (1, 2):  # parameters and Adam's state (moments, step) after each epoch
            assert _max_diff(_saved(outs[engine], epoch), refs[epoch]) <= bound, (engine, epoch)
        ranks = _records(outs[engine])
        if bound == 0.0:
            assert {r["checksum"] for r in ranks} == {ref_ranks[0]["checksum"]}, engine
        for r in ranks:  # every optimizer step went through dk.step; the ranks end alike
            assert (r["backend"], r["reduce_type"], r["world_size"], r["steps"], r["ranks_in_sync"]) == (
                engine, mode, RANKS, batches // accum, True), (engine, r)
            assert r["param_sync_step"] == (2 if mode == "param" else None)
            assert r["comm_bytes"] > 0 or RANKS == 1  # the engine reduced (grad: each step's gradients; param: means)
        assert ranks[0]["backend_impl"].startswith({"ddp": "torch", "mpi": "mpi4py", "horovod": "horovod"}[engine])


#: config heads RETURNN's start refuses in one line, exit 2: (head, what the line must say); 1 rank each
REFUSED = {
    "deepspeed": ('import distkit.integrations.returnn\n'
                  'torch_distributed = distkit.integrations.returnn.torch_distributed(backend="deepspeed")\n',
                  ("deepspeed engine under RETURNN's engine", "use backend ddp, mpi, horovod")),
    "no_epoch_end": ('import distkit.integrations.returnn\ntorch_distributed = distkit.integrations.returnn.torch_distributed(backend="ddp", '
                     'reduce_type="param")\n', ("epoch_end = distkit.integrations.returnn.epoch_end",)),
    "typo": ('import distkit.integrations.returnn\ntorch_distributed = distkit.integrations.returnn.torch_distributed(backend="ddp", '
             'reduce_typ="param")\n', ("unknown 'distributed' key 'reduce_typ'", "did you mean 'reduce_type'")),
}


def test_returnn_refusals_are_one_line(tmp_path: Path) -> None:
    """What RETURNN's loop cannot drive stops at RETURNN's start: one line ``distkit: error: ...`` naming the fix,
    exit 2, no traceback (the three cases at once, one rank each)."""
    procs = {}
    for name, (head, _) in REFUSED.items():
        cfg, _ = _config(tmp_path, name, head)
        env = base_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(_port()))
        procs[name] = subprocess.Popen([sys.executable, "-m", "returnn", str(cfg)], cwd=tmp_path, env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    for name, p in procs.items():
        out, err = p.communicate(timeout=120)
        lines = [ln for ln in err.splitlines() if ln.startswith("distkit: error:")]
        assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in err, (name, p.returncode, out[-1500:], err)
        for phrase in REFUSED[name][1]:
            assert phrase in lines[0], (name, lines[0])


# -- without processes ------------------------------------------------------------------------------------------------
def test_resolve_refuses_what_returnns_loop_cannot_drive() -> None:
    from distkit.errors import ConfigError, UnsupportedCombination
    from distkit.integrations.returnn import resolve

    cfg = resolve({"seed": 3}, backend="mpi", reduce_type="param", param_sync_step=7)
    assert (cfg.seed, cfg.distributed.backend, cfg.distributed.reduce_type, cfg.distributed.param_sync_step) == (
        3, "mpi", "param", 7)
    with pytest.raises(UnsupportedCombination, match="FSDP shards the parameters"):
        resolve(backend="fsdp")
    with pytest.raises(UnsupportedCombination, match="torch_amp"):
        resolve({"precision": "bf16-mixed"}, backend="ddp")
    with pytest.raises(UnsupportedCombination, match="gradient_clip_global_norm"):
        resolve({"gradient_clip": 1.0}, backend="ddp")
    with pytest.raises(ConfigError, match="did you mean 'param_sync_step'"):
        resolve(backend="ddp", param_sync_stp=3)


def test_cpu_device_check_names_returnns_assertion() -> None:
    from distkit.errors import ConfigError
    from distkit.integrations.returnn import _UNSET, check_cpu_device

    check_cpu_device("cpu", [])
    check_cpu_device(_UNSET, ["cfg.py", "++device", "cpu"])
    for device in (_UNSET, "gpu", None):
        with pytest.raises(ConfigError, match='put device = "cpu" above the torch_distributed line'):
            check_cpu_device(device, ["cfg.py"])


def test_torch_distributed_is_what_returnn_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """RETURNN's reduce_type stays "grad" (RETURNN then builds the class), distkit's keys travel in "options"."""
    import distkit.integrations.returnn

    monkeypatch.setattr(sys, "argv", ["cfg.py", "++device", "cpu"])  # (no RETURNN config around: its device check)

    got = distkit.integrations.returnn.torch_distributed(backend="mpi", reduce_type="param", param_sync_step=4,
                                            dataset_distribution="shard")
    assert got["reduce_type"] == "grad" and got["class"] is distkit.integrations.returnn.DistkitDDP
    assert got["options"] == {"distkit": {"config": None, "distributed": {
        "backend": "mpi", "reduce_type": "param", "param_sync_step": 4}}}
    assert got["dataset_distribution"] == "shard"
    assert got.get("backend") == (None if torch.cuda.is_available() else "gloo")


def test_mpi_engines_need_mpi_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun's variables (2 ranks that are no MPI processes) the mpi and horovod engines are refused with
    RETURNN's mpirun line, before RETURNN starts its process group; ddp is fine there."""
    from distkit.errors import UnsupportedCombination
    from distkit.integrations.returnn import _check_launcher, resolve

    for key, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="29500", TORCHELASTIC_RUN_ID="x").items():
        monkeypatch.setenv(key, value)
    for key in [k for k in os.environ if k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_", "HOROVOD_"))]:
        monkeypatch.delenv(key)
    _check_launcher(resolve(backend="ddp"))
    for engine in ("mpi", "horovod"):
        with pytest.raises(UnsupportedCombination, match="mpirun -np 2 python -m returnn CONFIG"):
            _check_launcher(resolve(backend=engine))
