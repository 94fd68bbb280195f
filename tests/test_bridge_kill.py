"""Resume after a kill, through every bridge (issue 57's front-door table): a rank SIGKILLed during training, after
the framework wrote a checkpoint, ends the job (the surviving rank stopped, a non-zero exit); the same command run
again resumes from the last checkpoint the framework wrote and ends exactly where the uninterrupted run ends.

The doors and their resume: Lightning's ``Trainer`` (``DistkitStrategy``; ``fit(ckpt_path="last")`` with
``ModelCheckpoint(save_last=True)``), Lightning's ``Fabric`` (``fabric.load`` of the file ``fabric.save`` rewrites
after each epoch), ``transformers.Trainer`` (``DistkitTrainer``; ``train(resume_from_checkpoint=True)`` where
``get_last_checkpoint`` finds one, as transformers' example scripts do) and an Accelerate loop (``ParamSync``;
``accelerator.load_state()`` of the newest automatically named ``save_state``). Each in grad and param mode where
the bridge takes it, on every engine it takes (Lightning and Fabric: ddp, mpi, horovod; the Hugging Face bridges:
ddp).

The kill is a real SIGKILL that the rank sends itself from the framework's own hook (a Lightning callback, a
``TrainerCallback``, the loop's body) at a step the script names, after writing a stamp file: distkit's
``DISTKIT_FAULT`` fires inside distkit's own loop only, and these loops are the frameworks'. The comparisons are
bit for bit (``torch.equal``): the bridges' clean resumes are already exact (tests/test_lightning.py L1-L5 assert
1e-6 and measure 0.0; tests/test_hf.py H2, H9, H10 assert bit for bit), and a kill adds nothing that may move a
number. What the kill adds is asserted: the job ends with a non-zero exit and neither rank finishes its run (the
surviving rank is ended by the launcher: torchrun's agent, or distkit's mpirun under ``--nprocs``, within the
launch's time limit: no hang), the checkpoint directory at the kill holds what the stamp lists, and the resumed run
starts from the last checkpoint and trains only the steps after it (a run that started again from nothing would
also end equal: it is refused by that count).

Process starts are the cost: the cases of one test form a chain of launches of one command, each launch with
``KILL`` naming the case to kill. A launch skips the cases that are done, resumes the one the previous launch
killed (its checkpoint is there) and runs it to the end, runs the next case uninterrupted (the reference), then runs
that case again from nothing, with the kill armed: n cases take n + 1 launches, and the last launch has no kill.
A test runs one door on one engine in grad, then param mode (3 launches, under THREE_LAUNCHES' per-test limit);
the Hugging Face bridges run under torchrun, Lightning and Fabric under torchrun (ddp) and ``--nprocs 2`` (mpi,
horovod: distkit's mpirun).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import BIN, ok, run

#: torchrun starting 2 ranks (its own rendezvous on a free port)
TORCHRUN = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", "0", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "localhost:0"]

#: the step of each case's run at which rank 1 SIGKILLs itself (Lightning and Fabric: 8 steps an epoch, checkpoints
#: at the end of epochs 1 and 2 (steps 8 and 16): killed 4 steps into the third epoch, 3 epochs in all)
KILL_STEP = {"lightning": 20, "fabric": 20, "trainer": 6, "paramsync": 9}

#: what each rank writes at the end of every case's run, in each launch: Lightning and Fabric
LIGHTNING = r'''
import argparse, json, os, signal, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
import lightning.pytorch as pl
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
import distkit
from distkit.lightning import DistkitStrategy

SEED, EPOCHS, BATCH = 7, 3, 4
KILL_STEP = json.loads(os.environ["KILL_STEPS"])


class RandomDataset(Dataset):  # Lightning's bug report template's data: 64 samples, 8 steps an epoch per rank
    def __init__(self, size, length, seed):
        self.data = torch.randn(length, size, generator=torch.Generator().manual_seed(seed))
    def __getitem__(self, index):
        return self.data[index]
    def __len__(self):
        return len(self.data)


class BoringModel(LightningModule):  # the template's module, its loss a mean square (training moves it)
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)
    def forward(self, x):
        return self.layer(x)
    def training_step(self, batch, batch_idx):
        return self(batch).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


TRAIN = RandomDataset(32, 64, 1)


def loader():
    return DataLoader(TRAIN, batch_size=BATCH, shuffle=True)


def die(case, rank, step, where):
    """Rank 1 at the case's kill step: a stamp (the step, what the checkpoint directory holds), then SIGKILL."""
    armed = os.environ.get("KILL") == case and os.path.basename(where) == "run"  # (never the reference run)
    if armed and rank == 1 and step == KILL_STEP[case.split("-")[0]]:
        with open(os.path.join(args.out, f"killed-{case}.json"), "w") as f:
            json.dump({"step": step, "time": time.time(), "saved": sorted(os.listdir(where))}, f)
        os.kill(os.getpid(), signal.SIGKILL)


class KillAt(pl.Callback):
    """Counts the steps this process trains (a resume runs only those after its checkpoint), and kills (die)."""
    def __init__(self, case, where):
        self.case, self.where, self.trained = case, where, 0
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.trained += 1
        die(self.case, trainer.global_rank, trainer.global_step, self.where)


def lightning_fit(case, source, where):
    """3 epochs of fit, ModelCheckpoint(save_last=True) writing after each, ``fit(ckpt_path="last")``: the same
    call starts from nothing or resumes from the last checkpoint there. The final state, the file it resumed from."""
    pl.seed_everything(SEED)
    model, strategy = BoringModel(), DistkitStrategy(source)
    ckpt = ModelCheckpoint(dirpath=where, save_last=True, save_top_k=-1, filename="{epoch}")
    counted = KillAt(case, where)
    t = Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=EPOCHS, logger=False,
                callbacks=[ckpt, counted], enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0)
    t.fit(model, loader(), ckpt_path="last")
    return dict(state={k: v.detach().clone() for k, v in model.state_dict().items()}, steps=t.global_step,
                trained=counted.trained,
                resumed=os.path.basename(t.ckpt_path) if t.ckpt_path else None,
                engine=[strategy.dk.backend, strategy.dk.cfg.distributed.reduce_type])


def fabric_fit(case, source, where):
    """Fabric's loop on the same layer and data, ``fabric.save(last.ckpt)`` after each epoch (the epoch count in
    it), and at the start ``fabric.load`` of that file where it exists (+ each rank's sidecar in param mode); param
    mode ends with ``dk.finish()`` as distkit's own loop does."""
    from lightning.fabric import Fabric
    strategy = DistkitStrategy(source)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    pl.seed_everything(SEED)
    model = torch.nn.Linear(32, 2)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    data = fabric.setup_dataloaders(loader())
    os.makedirs(where, exist_ok=True)
    path, state = os.path.join(where, "last.ckpt"), {"model": model, "optimizer": optimizer, "epoch": 0}
    resumed = os.path.exists(path)
    if resumed:
        fabric.load(path, state)
    trained = 0
    for epoch in range(state["epoch"], EPOCHS):
        data._num_iter_calls = epoch  # (Fabric sets the sampler's epoch from its count of passes over the loader)
        for i, x in enumerate(data):
            optimizer.zero_grad()
            fabric.backward(model(x).pow(2).mean())
            optimizer.step()
            trained += 1
            die(case, fabric.global_rank, epoch * len(data) + i + 1, where)
        state["epoch"] = epoch + 1
        fabric.save(path, state)
    if strategy.dk.cfg.distributed.reduce_type == "param":
        strategy.dk.finish()
    return dict(state={k: v.detach().clone() for k, v in model.state_dict().items()}, steps=EPOCHS * len(data),
                trained=trained,
                resumed="last.ckpt" if resumed else None,
                engine=[strategy.dk.backend, strategy.dk.cfg.distributed.reduce_type])


parser = argparse.ArgumentParser()
parser.add_argument("out")
distkit.add_arguments(parser)
args = parser.parse_args()
launcher = DistkitStrategy(args)  # under --nprocs 2: starts the 2 ranks here
rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
ENGINE = json.loads(os.environ["ENGINE"])  # {"backend": ...} (+ require_horovod)
for case in os.environ["CASES"].split(","):
    door, mode = case.split("-")
    fit = lightning_fit if door == "lightning" else fabric_fit
    source = {"distributed": {**ENGINE, **({"reduce_type": "param", "param_sync_step": 3} if mode == "param" else {})}}
    done = os.path.join(args.out, f"{case}-run-{rank}.pt")
    if os.path.exists(done):
        continue
    ref = os.path.join(args.out, f"{case}-ref-{rank}.pt")
    if not os.path.exists(ref):  # the uninterrupted run, once, in its own directory
        torch.save(fit(case, source, os.path.join(args.out, case, "ref")), ref)
    torch.save(fit(case, source, os.path.join(args.out, case, "run")), done)  # killed where KILL names the case
'''


#: the Hugging Face bridges under torchrun: DistkitTrainer (tiny GPT-2, dropout 0.1) in grad and param mode, and an
#: Accelerate loop with ParamSync (a BatchNorm + dropout MLP, DiLoCo's extras: an exchange in flight at the save)
HF = r"""
import json, os, signal, sys, time
import torch
from torch import nn
from torch.utils.data import Dataset
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint
from distkit.hf import DistkitTrainer, ParamSync

out = sys.argv[1]
rank = int(os.environ["RANK"])
KILL_STEP = json.loads(os.environ["KILL_STEPS"])
OUTER = {"class": "nesterov", "lr": 0.7, "momentum": 0.9}
EXTRAS = {"distributed": {"param_sync_fragments": 2, "param_sync_compression": "int8", "param_sync_overlap": 1}}
# tests/test_hf.py's param mode: H = 3, 2 fragments, int8, overlap 1, the outer Nesterov step: at the checkpoint
# after step 4 fragment 1's exchange is in flight and the ranks' replicas differ
PARAM = {"distributed": {"reduce_type": "param", "param_sync_step": 3, **EXTRAS["distributed"]},
         "param_outer_optimizer": OUTER}


def state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def die(case, step, where):
    # rank 1 at the case's kill step, in the run KILL names: a stamp (the step, what is saved), then SIGKILL
    if rank == 1 and step == KILL_STEP[case.split("-")[0]] and os.environ.get("KILL") == case and \
            os.path.basename(where) == "run":
        with open(os.path.join(out, f"killed-{case}.json"), "w") as f:
            json.dump({"step": step, "time": time.time(), "saved": sorted(os.listdir(where))}, f)
        os.kill(os.getpid(), signal.SIGKILL)


class Tokens(Dataset):  # 64 random sequences: 8 steps of 4 per rank on 2 ranks
    ids = torch.randint(0, 64, (64, 32), generator=torch.Generator().manual_seed(7))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class KillAt(TrainerCallback):
    # counts the steps this process trains (a resume runs only those after its checkpoint), and kills (die)
    def __init__(self, case, where):
        self.case, self.where, self.trained = case, where, 0

    def on_step_end(self, args, state, control, **kw):
        self.trained += 1
        die(self.case, state.global_step, self.where)


def trainer_fit(case, mode, where):
    # 8 steps, a checkpoint every 4 (checkpoint-4, checkpoint-8), dropout on, a log every step; resumed with
    # train(resume_from_checkpoint=True) where get_last_checkpoint finds one (transformers' example scripts)
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.1,
                                   embd_pdrop=0.1, attn_pdrop=0.1))
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    targs = TrainingArguments(output_dir=where, use_cpu=True, seed=3, report_to=[], per_device_train_batch_size=4,
                              disable_tqdm=True, dataloader_num_workers=0, max_steps=8, logging_steps=1,
                              save_strategy="steps", save_steps=4)
    counted = KillAt(case, where)
    t = DistkitTrainer(m, targs, train_dataset=Tokens(), optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 1.0)), callbacks=[counted], distkit=PARAM if mode == "param" else None)
    t.model_accepts_loss_kwargs = False
    last = get_last_checkpoint(where) if os.path.isdir(where) else None
    t.train(resume_from_checkpoint=True if last else None)
    log = [{k: v for k, v in h.items() if not k.endswith(("_runtime", "_per_second")) and k != "train_loss"}
           for h in t.state.log_history]  # (train_loss: the mean over this call's steps, as the Trainer's resume)
    return dict(state=state(t.model), steps=t.state.global_step, trained=counted.trained, log=log,
                resumed=os.path.basename(last) if last else None,
                engine=[t.dk.backend, t.dk.cfg.distributed.reduce_type])


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))


def data(step):  # each rank its own batches, the same in every run
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(8, 8, generator=g)
    return x, 2 * x[:, :1] - x[:, 1:2]


def paramsync_fit(case, mode, where):
    # 12 steps of ParamSync (K = 4, DiLoCo's extras), accelerator.save_state() after steps 3 and 6 (automatic
    # naming: checkpoints/checkpoint_0, _1; after step 6 fragment 1's exchange is in flight), and at the start
    # accelerator.load_state() of the newest where one exists: the loop goes on from ParamSync's restored step count
    project = ProjectConfiguration(project_dir=where, automatic_checkpoint_naming=True)
    acc = Accelerator(cpu=True, project_config=project)
    m = mlp()
    m, opt = acc.prepare(m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9))
    sync = ParamSync(acc, m, local_sgd_steps=4, config=EXTRAS)
    acc.register_for_checkpointing(sync)
    saved = os.path.join(where, "checkpoints")
    resumed = sorted(os.listdir(saved))[-1] if os.path.isdir(saved) and os.listdir(saved) else None
    if resumed:
        acc.load_state()
    trained = 0
    with sync:
        for step in range(sync.num_steps, 12):
            x, y = data(step)
            acc.backward(nn.functional.mse_loss(m(x), y))
            opt.step()
            opt.zero_grad()
            sync.step()
            trained += 1
            if sync.num_steps in (3, 6):
                acc.save_state()
            die(case, sync.num_steps, where)
    return dict(state=state(acc.unwrap_model(m)), steps=sync.num_steps, trained=trained, resumed=resumed,
                engine=["ddp", "param"])


for case in os.environ["CASES"].split(","):
    door, mode = case.split("-")
    fit = trainer_fit if door == "trainer" else paramsync_fit
    done = os.path.join(out, f"{case}-run-{rank}.pt")
    if os.path.exists(done):
        continue
    ref = os.path.join(out, f"{case}-ref-{rank}.pt")
    if not os.path.exists(ref):  # the uninterrupted run, once, in its own directory
        torch.save(fit(case, mode, os.path.join(out, case, "ref")), ref)
    torch.save(fit(case, mode, os.path.join(out, case, "run")), done)  # killed where KILL names the case
"""


def _chain(out: Path, body: str, cases: list[str], prefix: list[str], suffix: tuple[str, ...] = (),
           timeout: float = 170, **env: str) -> list[dict[str, Any]]:
    """Run ``body`` as the chain of launches of one command, ``prefix SCRIPT OUT suffix``, for ``cases`` (the
    module's docstring). Per launch: the case it killed (None: the last launch), its return code, stderr's tail, the
    runs done after it (``CASE-run-RANK.pt``), and the seconds from the kill's stamp to the launch's end (the
    surviving rank's stop, as the launcher reported it). The launch without a kill must succeed."""
    out.mkdir()
    script = out / "job.py"
    script.write_text(body)
    cmd = [*prefix, str(script), str(out), *suffix]
    launches = []
    for kill in [*cases, None]:
        res = run(cmd, timeout=timeout, CASES=",".join(cases), KILL_STEPS=json.dumps(KILL_STEP), KILL=kill or "",
                  **env)
        ended = time.time()
        (out / f"launch-{kill or 'last'}.log").write_text(res.stdout + res.stderr)  # (for whoever reads a failure)
        stamp = out / f"killed-{kill}.json"
        launches.append({"kill": kill, "rc": res.returncode, "stderr": res.stderr[-3000:],
                         "done": sorted(p.name for p in out.glob("*-run-*.pt")),
                         "stop_s": ended - json.loads(stamp.read_text())["time"] if stamp.exists() else None})
        if kill is None:
            ok(res)
    return launches


#: the per-test limit of the tests of 3 launches of 2 ranks importing Lightning or transformers: setup.cfg's 180 s
#: holds about 2 of them on a loaded machine (measured with 3 other sessions' multi-process tests beside them, load
#: average 10 to 15 on 2 cores: 57 to 134 s a test, and one past 180 s); each launch keeps its own limit of 170 s
#: (_chain), so that a hang still fails at the launch it happens in
THREE_LAUNCHES = pytest.mark.timeout(400)

#: engine -> how its chain is launched (before and after ``SCRIPT OUT``) and the ENGINE keys its strategies get
LAUNCH: dict[str, tuple[list[str], tuple[str, ...], dict[str, Any]]] = {
    "ddp": (TORCHRUN, (), {"backend": "ddp"}),
    "mpi": ([sys.executable], ("--nprocs", "2", "++distributed.backend", "mpi"), {"backend": "mpi"}),
    "horovod": ([sys.executable], ("--nprocs", "2", "++distributed.backend", "horovod"),
                {"backend": "horovod", "require_horovod": True}),
}


def _lightning_chain(tmp_path: Path, door: str, engine: str) -> tuple[Path, list[dict[str, Any]]]:
    """The chain of ``door`` (lightning, fabric) in grad, then param mode on ``engine``: 3 launches."""
    prefix, suffix, keys = LAUNCH[engine]
    out = tmp_path / "chain"
    return out, _chain(out, LIGHTNING, [f"{door}-grad", f"{door}-param"], prefix, suffix, ENGINE=json.dumps(keys))


#: per door: the steps of the whole run, the step of the checkpoint the resume starts from, and what the kill's
#: stamp must list in the checkpoint directory (the checkpoints written before it; param mode: + each rank's
#: sidecar, ``.distkit``)
EXPECTED = {
    "lightning": (24, 16, {"grad": ["epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"],
                           "param": ["epoch=0.ckpt", "epoch=0.ckpt.distkit", "epoch=1.ckpt", "epoch=1.ckpt.distkit",
                                     "last.ckpt", "last.ckpt.distkit"]}, "last.ckpt"),
    "fabric": (24, 16, {"grad": ["last.ckpt"], "param": ["last.ckpt", "last.ckpt.distkit"]}, "last.ckpt"),
    "trainer": (8, 4, {"grad": ["checkpoint-4"], "param": ["checkpoint-4"]}, "checkpoint-4"),
    "paramsync": (12, 6, {"param": ["checkpoints"]}, "checkpoint_1"),
}


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _check_case(out: Path, launches: list[dict[str, Any]], case: str, engine: str) -> list[dict[str, Any]]:
    """One case of a chain: the launch that killed it ended non-zero with rank 1 killed at the case's step, after the
    checkpoints EXPECTED lists and before either rank ended the run; the next launch (the same command) resumed from
    the last checkpoint, trained only the steps after it, and ended with the uninterrupted run's state on both
    ranks, bit for bit. Each rank's (uninterrupted, resumed) results."""
    door, mode = case.split("-")
    total, at, saved, resumed_from = EXPECTED[door]
    i = next(k for k, launch in enumerate(launches) if launch["kill"] == case)
    killed = launches[i]
    assert killed["rc"] != 0, killed
    assert not any(name.startswith(f"{case}-run-") for name in killed["done"]), killed  # no rank ended its run
    stamp = json.loads((out / f"killed-{case}.json").read_text())
    assert stamp["step"] == KILL_STEP[door] and stamp["saved"] == saved[mode], stamp
    assert all(name.startswith(f"{case}-run-") for name in set(launches[i + 1]["done"]) - set(killed["done"]))
    rows = []
    for rank in (0, 1):
        ref = torch.load(out / f"{case}-ref-{rank}.pt", weights_only=False)
        got = torch.load(out / f"{case}-run-{rank}.pt", weights_only=False)
        for res in (ref, got):
            assert res["engine"] == [engine, mode] and res["steps"] == total, (case, res["engine"], res["steps"])
        assert (ref["resumed"], ref["trained"]) == (None, total), (case, ref["resumed"], ref["trained"])
        assert (got["resumed"], got["trained"]) == (resumed_from, total - at), (case, got["resumed"], got["trained"])
        assert _identical(got["state"], ref["state"]), (case, rank, _max_diff(got["state"], ref["state"]))
        rows.append({"ref": ref, "got": got})
    return rows


@THREE_LAUNCHES
@pytest.mark.parametrize("engine", ["ddp", "mpi", "horovod"])
def test_lightning_trainer_killed_during_fit_resumes_from_last_as_the_uninterrupted_run(
        tmp_path: Path, engine: str) -> None:
    """Lightning's ``Trainer(strategy=DistkitStrategy(...))``, 3 epochs, ``ModelCheckpoint(save_last=True)``: rank 1
    SIGKILLed at step 20 (after the checkpoints of epochs 1 and 2) ends the job non-zero; ``fit(ckpt_path="last")``
    in new processes resumes from ``last.ckpt`` (param mode: + each rank's sidecar, the ranks mid-period at step 16
    with ``param_sync_step`` 3), trains the 8 steps after it and ends with the uninterrupted run's parameters, bit for
    bit, in grad and param mode."""
    out, launches = _lightning_chain(tmp_path, "lightning", engine)
    for mode in ("grad", "param"):
        _check_case(out, launches, f"lightning-{mode}", engine)


@THREE_LAUNCHES
@pytest.mark.parametrize("engine", ["ddp", "mpi", "horovod"])
def test_fabric_killed_resumes_from_its_last_save_as_the_uninterrupted_run(
        tmp_path: Path, engine: str) -> None:
    """Fabric with ``DistkitStrategy``, ``fabric.save(last.ckpt)`` after each epoch (the epoch count in it): rank 1
    SIGKILLed at step 20 ends the job non-zero; ``fabric.load`` of that file in new processes (param mode: + each
    rank's sidecar) and the epoch after it end with the uninterrupted run's parameters, bit for bit."""
    out, launches = _lightning_chain(tmp_path, "fabric", engine)
    for mode in ("grad", "param"):
        _check_case(out, launches, f"fabric-{mode}", engine)


@THREE_LAUNCHES
def test_distkit_trainer_killed_resumes_from_checkpoint_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """``DistkitTrainer`` (tiny GPT-2, dropout 0.1), 8 steps, a checkpoint every 4: rank 1 SIGKILLed at step 6 ends
    the job non-zero; ``train(resume_from_checkpoint=True)`` in new processes resumes from checkpoint-4 (param mode:
    mid-period, an exchange in flight, each rank's replica and random stream from its own state), trains the 4 steps
    after it and ends with the uninterrupted run's parameters, bit for bit, and rank 0's ``log_history`` (every step's
    loss, grad_norm and learning rate; ``train_loss`` left out, the mean over the steps of one call)."""
    out = tmp_path / "chain"
    launches = _chain(out, HF, ["trainer-grad", "trainer-param"], TORCHRUN)
    for mode in ("grad", "param"):
        rows = _check_case(out, launches, f"trainer-{mode}", "ddp")
        for row in rows:
            assert [h["step"] for h in row["ref"]["log"] if "loss" in h] == list(range(1, 9))
        # rank 0 logs and writes trainer_state.json: its log_history is the uninterrupted run's
        assert rows[0]["got"]["log"] == rows[0]["ref"]["log"], (mode, rows[0]["got"]["log"], rows[0]["ref"]["log"])
        # rank 1 resumed the history before the checkpoint from that file, rank 0's: in param mode each rank's
        # grad_norm is its own (tests/test_hf.py H11), so there it holds rank 0's; after the checkpoint, its own
        ref, got = rows[1]["ref"]["log"], rows[1]["got"]["log"]
        before = ref if mode == "grad" else rows[0]["ref"]["log"]
        assert got[4:] == ref[4:] and got[:4] == before[:4], (mode, got, ref)


def test_param_sync_killed_resumes_from_load_state_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """An Accelerate loop with ``ParamSync`` (K = 4, outer Nesterov, 2 fragments, int8, overlap 1; a BatchNorm +
    dropout MLP), ``accelerator.save_state()`` after steps 3 and 6 (automatic naming): rank 1 SIGKILLed at step 9
    ends the job non-zero; ``accelerator.load_state()`` in new processes loads the newest (checkpoint_1: an exchange
    in flight), and the loop from ParamSync's restored step count ends with the uninterrupted run's parameters and
    buffers, bit for bit."""
    out = tmp_path / "chain"
    launches = _chain(out, HF, ["paramsync-param"], TORCHRUN)
    rows = _check_case(out, launches, "paramsync-param", "ddp")
    assert _identical(rows[0]["got"]["state"], rows[1]["got"]["state"])  # (the final sync: one model)
