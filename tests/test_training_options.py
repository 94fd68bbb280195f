"""Optimizers, LR schedules, mixed precision and callbacks in `distkit train`, on every engine (real processes).

Closed forms: the logged learning rate is the schedule's formula at every step on every engine; under
bf16-mixed the forward really runs in bfloat16 (the step reports its output dtype); a resumed run with a
schedule ends bit-identical to an uninterrupted one; a stop requested by one rank's callback ends every
rank after the same step.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import distkit, final_params, max_abs_diff, ok, summary
import tiers  # (a hand-written tier reason is one of its constants: an unknown one makes the test serial)

STEPS, WARMUP, LR = 12, 3, 0.01

OPTIONS_CONFIG = f'''
import torch
import torch.nn.functional as F

task = "digits"
optimizer = {{"class": "RMSprop", "alpha": 0.9}}   # any torch.optim class, by name
learning_rate = {LR}
lr_scheduler = {{"class": "cosine", "warmup_steps": {WARMUP}}}
precision = "bf16-mixed"
max_steps = {STEPS}
log_every = 1
batch_size = 16
progress_bar = False

def train_step(model, batch):
    x, y = batch
    out = model(x)
    # report the forward's dtype: 1.0 when the matmuls ran in bfloat16
    return F.cross_entropy(out.float(), y), {{"bf16": float(out.dtype == torch.bfloat16)}}
'''

ENGINES = {
    "ddp": [],
    "mpi": ["++distributed", "{'backend': 'mpi'}"],
    "horovod": ["++distributed", "{'backend': 'horovod', 'require_horovod': True}"],
    "deepspeed": ["++deepspeed_config", "{'zero_optimization': {'stage': 2}}"],
}


def expected_lr(step: int) -> float:
    """The lr in effect after ``step`` optimizer steps: linear warm-up, then half a cosine to 0."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    return LR * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP) / (STEPS - WARMUP))))


def lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("options") / "options.py"
    path.write_text(OPTIONS_CONFIG)
    return path


@pytest.fixture(scope="module")
def runs(config: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One 2-rank run per engine (started lazily, shared by the tests below)."""
    root, done = tmp_path_factory.mktemp("engines"), {}

    class Runs(dict):
        def __missing__(self, engine: str) -> Path:
            out = root / engine
            ok(distkit("train", str(config), "--nprocs", "2", "++output_dir", str(out), *ENGINES[engine], timeout=300))
            self[engine] = out
            return out
    return Runs(done)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_schedule_optimizer_and_bf16_on_every_engine(runs: dict[str, Path], engine: str) -> None:
    out = runs[engine]
    logged = lines(out)
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    for r in logged:
        assert r["lr"] == pytest.approx(expected_lr(r["step"]), rel=1e-9, abs=1e-12), r
        assert r["bf16"] == 1.0, r  # autocast (or DeepSpeed's bf16 engine) ran the forward in bfloat16
        assert math.isfinite(r["loss"])
    assert logged[-1]["loss"] < logged[0]["loss"]
    s = summary(out)
    assert s["ranks_in_sync"] is True and s["steps"] == STEPS
    resolved = json.loads((out / "config.resolved.json").read_text())
    assert resolved["precision"] == "bf16-mixed" and resolved["optimizer"]["class"] == "RMSprop"
    if engine == "deepspeed":  # precision selected DeepSpeed's own bf16 block
        ds = json.loads((out / "deepspeed_config.resolved.json").read_text())
        assert ds["bf16"] == {"enabled": True}


@pytest.mark.full(tiers.SWEEP)  # (mpi and horovod against DDP, in one test)
def test_grad_engines_agree_under_bf16(runs: dict[str, Path]) -> None:
    ref = final_params(runs["ddp"])
    for engine in ("mpi", "horovod"):
        assert max_abs_diff(final_params(runs[engine]), ref) <= 1e-5, engine


def test_schedule_state_resumes_bit_identical(runs: dict[str, Path], config: Path, tmp_path: Path) -> None:
    out = tmp_path / "killed"
    args = ["train", str(config), "--nprocs", "2", "++output_dir", str(out), "++checkpoint_every", "4"]
    killed = distkit(*args, DISTKIT_FAULT="1:7:kill")
    assert killed.returncode != 0 and (out / "checkpoints" / "latest").read_text() == "step-0000004"
    ok(distkit(*args, "++resume", "auto"))
    a, b = final_params(runs["ddp"]), final_params(out)
    assert all(a[k].equal(b[k]) for k in a)  # the schedule continued at step 4, not from its warm-up
    # the resumed run's lines (appended after those the killed run wrote past step 4) match the reference's
    resumed = {r["step"]: r["lr"] for r in lines(out)}
    assert resumed == {r["step"]: r["lr"] for r in lines(runs["ddp"])}


CALLBACK_CONFIG = '''
import json, os

class Recorder:
    """Records every hook call; rank 1 alone asks to stop once 5 steps are done."""

    def __init__(self):
        self.calls = []

    def on_train_start(self, trainer):
        self.calls.append(["start", trainer.step])

    def on_step_end(self, trainer, metrics):
        self.calls.append(["step", trainer.step, metrics["step"]])
        if trainer.rank == 1 and trainer.step >= 5:
            trainer.request_stop()

    def on_eval_end(self, trainer, metrics):
        self.calls.append(["eval", trainer.step, sorted(metrics)])

    def on_checkpoint(self, trainer, path):
        self.calls.append(["checkpoint", trainer.step, os.path.basename(path)])

    def on_train_end(self, trainer, summary):
        self.calls.append(["end", trainer.step, summary["steps"], summary["stopped_early"]])
        with open(os.path.join(trainer.cfg.output_dir, f"calls{trainer.rank}.json"), "w") as f:
            json.dump(self.calls, f)

task = "digits"
callbacks = [Recorder()]
max_steps = 40
log_every = 2
eval_every = 4
checkpoint_every = 4
progress_bar = False
'''


@pytest.mark.parametrize("engine", ["ddp", "mpi"])
def test_callbacks_and_a_stop_from_one_rank_end_every_rank_at_the_same_step(tmp_path: Path, engine: str) -> None:
    cfg = tmp_path / "cb.py"
    cfg.write_text(CALLBACK_CONFIG)
    res = ok(distkit("train", str(cfg), "--nprocs", "2", "++output_dir", str(tmp_path / "out"), *ENGINES[engine]))
    assert "stop requested by a callback; stopping after step 6" in res.stdout
    calls = [json.loads((tmp_path / "out" / f"calls{r}.json").read_text()) for r in (0, 1)]
    assert calls[0] == calls[1]  # every hook ran on every rank, in the same order
    assert calls[0] == [
        ["start", 0], ["step", 2, 2], ["step", 4, 4], ["eval", 4, ["eval_accuracy", "eval_loss"]],
        ["checkpoint", 4, "step-0000004"], ["step", 6, 6],  # rank 1 asked here: no step 8
        ["eval", 6, ["eval_accuracy", "eval_loss"]], ["checkpoint", 6, "step-0000006"], ["end", 6, 6, True],
    ]
    s = summary(tmp_path / "out")
    assert s["steps"] == 6 and s["stopped_early"] is True and s["ranks_in_sync"] is True


STARTED_CONFIG = '''
import json, os, sys

def _dynamo():
    mod = sys.modules.get("torch._dynamo")
    return None if mod is None else type(mod).__name__

class Started:
    """Writes what torch._dynamo is when training starts and when it ends: not imported, deferred or a module."""

    def on_train_start(self, trainer):
        self.start = _dynamo()

    def on_train_end(self, trainer, summary):
        with open(os.path.join(trainer.cfg.output_dir, f"started{trainer.rank}.json"), "w") as f:
            json.dump([self.start, _dynamo()], f)

task = "digits"
callbacks = [Started()]
max_steps = 4
progress_bar = False
'''


@pytest.mark.parametrize("mode,dynamo", [("param", "_Deferred"), ("grad", "module")])
def test_start_up_is_done_when_training_starts_in_param_mode_too(tmp_path: Path, mode: str, dynamo: str) -> None:
    """Issue 36 item 17: torch.optim imported torch._dynamo at the first optimizer step (1.2 s of CPU, 5 s under
    load), DDP's constructor in grad mode: param mode's first 10 steps counted it as training and its setup_time_s
    did not. Training imports nothing of it now: param mode never loads it (distkit.launch.lazy_import.defer_dynamo),
    grad mode's DDP wrapper loaded it in setup. Ranks in new interpreters (as under torchrun, mpirun, srun)."""
    cfg = tmp_path / "started.py"
    cfg.write_text(STARTED_CONFIG)
    out = tmp_path / "out"
    ok(distkit("train", str(cfg), "--nprocs", "2", "++output_dir", str(out), "++distributed.reduce_type", mode,
               DISTKIT_RANK_START="exec"))
    assert [json.loads((out / f"started{r}.json").read_text()) for r in (0, 1)] == [[dynamo, dynamo]] * 2


# Hugging Face's weight-decay grouping by parameter name, in an optimizer factory of a Python config.
NAMED_GROUPS_CONFIG = '''
import torch
from torch import nn


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(4, 8)
        self.LayerNorm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.LayerNorm(torch.relu(self.hidden(x))))


def model():
    return _Net()


def dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=g)
    return [(x[i], int(x[i].sum() > 0)) for i in range(96)]


def _groups(named_parameters):
    no_decay = ["bias", "LayerNorm.weight"]
    return [{"params": [p for n, p in named_parameters if not any(nd in n for nd in no_decay)], "weight_decay": 0.1},
            {"params": [p for n, p in named_parameters if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]

max_steps = 4
batch_size = 8
log_every = 2
progress_bar = False
'''

# the factory's signature decides what it gets (distkit.components.call_optimizer_factory)
FACTORIES = {
    "named_parameters": "def optimizer(named_parameters):\n    return torch.optim.AdamW(_groups(named_parameters), lr=0.01)\n",
    "params_and_named_parameters": ("def optimizer(params, named_parameters):\n    assert len(list(params)) == 6\n"
                                    "    return torch.optim.AdamW(_groups(named_parameters), lr=0.01)\n"),
    "params": "def optimizer(params):\n    return torch.optim.AdamW(params, lr=0.01)\n",  # the original form
}


@pytest.mark.parametrize("form", FACTORIES)
def test_optimizer_factory_gets_named_parameters_when_it_asks(tmp_path: Path, form: str) -> None:
    """Issue 22: an optimizer factory that names a parameter ``named_parameters`` gets the model's (name,
    parameter) pairs, so Hugging Face's decay / no-decay grouping by name can be written; ``params -> Optimizer``
    keeps working. Checked from the saved optimizer groups (by parameter name) of a 2-rank run."""
    from distkit import checkpoint, portable

    cfg, out = tmp_path / "cfg.py", tmp_path / "out"
    cfg.write_text(NAMED_GROUPS_CONFIG + FACTORIES[form])
    ok(distkit("train", str(cfg), "--nprocs", "2", "++output_dir", str(out)))
    latest = checkpoint.latest(str(out / "checkpoints"))
    assert latest is not None and latest.endswith("step-0000004")
    groups = [(g["params"], g["weight_decay"], g["lr"]) for g in portable.read_meta(latest)["optim_groups"]]
    if form == "params":
        assert groups == [(["hidden.weight", "hidden.bias", "LayerNorm.weight", "LayerNorm.bias", "out.weight",
                            "out.bias"], 0.01, 0.01)]  # one group, AdamW's default weight decay
    else:
        assert groups == [(["hidden.weight", "out.weight"], 0.1, 0.01),
                          (["hidden.bias", "LayerNorm.weight", "LayerNorm.bias", "out.bias"], 0.0, 0.01)]
    # every parameter was trained by the optimizer (AdamW state for each, 4 steps)
    entries = portable.read(latest)
    assert {k for k in entries if k.endswith("/step")} == {f"optim/{n}/step" for g in groups for n in g[0]}
    assert all(float(v) == 4 for k, v in entries.items() if k.endswith("/step"))
