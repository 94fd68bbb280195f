"""distkit.hf (issue 39, Hugging Face part): ParamSync under Accelerate and DistkitTrainer under transformers, on 2
real ranks (torchrun, gloo, CPU), real accelerate/transformers, tiny models, synthetic data, no downloads.

Two jobs for the whole file (process starts are the cost here): the first runs every training and writes what
it measured, per rank, to a file; the second starts new processes that resume from the first one's checkpoints.
The refusals that end a process have one test of their own.

- ParamSync at LocalSGD's settings equals Accelerate's LocalSGD bit for bit (a BatchNorm + dropout model: LocalSGD
  leaves buffers alone, and so does ParamSync), the same instance re-entered for a second epoch, evaluated after each
  block (gather_for_metrics); inside accelerator.accumulate with clip_grad_norm_; in Accelerate's own LocalSGD
  example converted to ParamSync too (examples/hf_local_sgd.py against the same file with LocalSGD back).
- ParamSync with the outer optimizer, 2 fragments, int8 and overlap 1 equals distkit's own loop in param mode with
  the same keys on the same per-rank batches, bit for bit.
- accelerator.save_state mid-period (ranks differ; with an exchange in flight) and load_state in new processes
  end where the uninterrupted run ends, bit for bit, on both of ParamSync's paths.
- DistkitTrainer in grad mode equals transformers.Trainer's own DDP run (tiny GPT-2, dropout on): the final
  parameters, log_history (every step's loss, grad_norm, learning rate, the evaluations at 4 and 8), the best
  checkpoint load_best_model_at_end loads, evaluate() and predict() after train(); with gradient accumulation; with
  bf16=True. Bit for bit here; the bound asserted is 1e-6. Resumed from checkpoint-4 in new processes it ends, logs
  and predicts as the uninterrupted run, bit for bit. In param mode (outer optimizer, dropout on) it equals distkit's
  own loop on the batches the Trainer drew with the masks it drew (outer optimizer, 2 fragments, int8, overlap 1); a
  checkpoint after step 4 (mid-period, an exchange in flight) resumed in new processes ends bit for bit where the
  run ended. With gradient accumulation, clipping and the Trainer's linear schedule it equals the own loop too: the
  model, every step's logged loss, grad_norm and learning rate, and predict()'s logits.
- DistkitTrainer with load_best_model_at_end in param mode, evaluated between syncs (issue 57 item 2): the best
  checkpoint holds the mean of the replicas, the evaluated model, which every rank ends with; its evaluate() is
  best_metric exactly. Its refusals (item 5): typed, naming the fix, before anything is written (caught in the job);
  uncaught, one line and exit 2 on every rank under torchrun, --nprocs and mpirun (one test, three launches at once).
"""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from conftest import BIN, ROOT, ok, run

EXAMPLE = ROOT / "examples" / "hf_local_sgd.py"
#: grad mode against the Trainer's DDP: the bound asserted (measured: 0.0, bit for bit)
GRAD_TOL = 1e-6

JOB = r'''
import contextlib, importlib.util, os, sys
import torch
from torch import nn
from torch.utils.data import Dataset
from accelerate import Accelerator
from accelerate.local_sgd import LocalSGD
from torch.utils.data import DataLoader, TensorDataset
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments,
                          default_data_collator, get_scheduler)
import distkit
from distkit.hf import DistkitTrainer, ParamSync

out, phase, example = sys.argv[1], sys.argv[2], sys.argv[3]
rank = int(os.environ["RANK"])
OUTER = {"class": "nesterov", "lr": 0.7, "momentum": 0.9}
# H = 4, F = 2 (offsets 0, 2), int8, each exchange applied one step after it starts
EXTRAS = {"param_outer_optimizer": OUTER,
          "distributed": {"param_sync_fragments": 2, "param_sync_compression": "int8", "param_sync_overlap": 1}}
res = {}


def state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# -- ParamSync under Accelerate --------------------------------------------------------------------------------
def mlp():  # (dropout: the RNG streams, per rank, are part of what must match and resume)
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))


def data(step):  # each rank its own batches, the same in every run
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(8, 8, generator=g)
    return x, 2 * x[:, :1] - x[:, 1:2]


def prepared(**kw):
    acc = Accelerator(cpu=True, **kw)
    m = mlp()
    m, opt = acc.prepare(m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9))
    return acc, m, opt


#: 14 held-out samples (not a multiple of 2 ranks x 4: the last batch padded, gather_for_metrics drops the copies)
HELD_X = torch.randn(14, 8, generator=torch.Generator().manual_seed(99))
HELD = TensorDataset(HELD_X, 2 * HELD_X[:, :1] - HELD_X[:, 1:2])


def evaluate(acc, m, loader):  # Accelerate's evaluation idiom: the prepared model, gather_for_metrics
    m.eval()
    preds, refs = [], []
    with torch.no_grad():
        for x, y in loader:
            p, y = acc.gather_for_metrics((m(x), y))
            preds.append(p)
            refs.append(y)
    m.train()
    preds, refs = torch.cat(preds), torch.cat(refs)
    return preds, float(nn.functional.mse_loss(preds, refs))


def train(acc, m, opt, sync, steps, save_at=None, save_dir=None):
    for step in steps:
        x, y = data(step)
        acc.backward(nn.functional.mse_loss(m(x), y))
        opt.step()
        opt.zero_grad()
        sync.step()
        if step == save_at:
            acc.save_state(save_dir)


# -- DistkitTrainer ------------------------------------------------------------------------------------------
# H = 3, F = 2 (fragment 1 at steps 1, 4, 7; fragment 0 at 3, 6), int8, overlap 1: at the checkpoint after step 4
# fragment 1's exchange is in flight
PARAM = {"distributed": {"reduce_type": "param", "param_sync_step": 3, **EXTRAS["distributed"]},
         "param_outer_optimizer": OUTER}


class Tokens(Dataset):  # 64 random sequences of the model's length: what a tokenized text dataset holds
    ids = torch.randint(0, 64, (64, 32), generator=torch.Generator().manual_seed(7))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Held(Tokens):  # 16 other sequences: the eval set (2 batches of 4 per rank)
    ids = torch.randint(0, 64, (16, 32), generator=torch.Generator().manual_seed(8))


#: DistkitTrainer's refusals: (name, distkit config, TrainingArguments keys)
REFUSED = [("mpi", {"distributed": {"backend": "mpi"}}, {}), ("horovod", {"distributed": {"backend": "horovod"}}, {}),
           ("fsdp", {"distributed": {"backend": "fsdp"}}, {}),
           ("deepspeed", {"distributed": {"backend": "deepspeed",
                                          "deepspeed_config": {"zero_optimization": {"stage": 2}}}}, {}),
           ("fp16", None, {"fp16": True})]


def gpt2(dropout):
    torch.manual_seed(0)
    p = 0.1 if dropout else 0.0
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                      resid_pdrop=p, embd_pdrop=p, attn_pdrop=p))


def targs(name, **kw):  # 64 samples / (4 per rank x 2 ranks): 8 steps, one epoch
    kw = {"save_strategy": "no", "max_steps": 8, "logging_steps": 100, **kw}
    return TrainingArguments(output_dir=os.path.join(out, name), use_cpu=True, seed=3, report_to=[],
                             per_device_train_batch_size=4, learning_rate=1e-3, disable_tqdm=True,
                             dataloader_num_workers=0, **kw)


def sgd(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def param_trainer(name, **kw):  # dropout on: each rank's RNG stream is checkpointed and resumed
    m = gpt2(True)
    t = DistkitTrainer(m, targs(name, **kw), train_dataset=Tokens(), optimizers=sgd(m), distkit=PARAM)
    t.model_accepts_loss_kwargs = False  # the loss as the model returns it (the own loop's)
    return t


def recorder(seen):  # a collator that keeps every batch this rank drew
    def collate(features):
        batch = default_data_collator(features)
        seen.append({k: v.clone() for k, v in batch.items()})
        return batch
    return collate


def logged(t):  # log_history without its timings
    return [{k: v for k, v in h.items() if not k.endswith(("_runtime", "_per_second"))} for h in t.state.log_history]


def predicted(t):  # predict() on the held-out set: the logits every rank gathers, and the loss
    out = t.predict(Held(), ignore_keys=["past_key_values"])
    return torch.from_numpy(out.predictions), out.metrics["test_loss"]


class Trained(TrainerCallback):  # the model as training left it (load_best_model_at_end loads another after it)
    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step == state.max_steps:
            self.model = {k: v.detach().clone() for k, v in model.state_dict().items()}


#: grad mode's Trainer runs: a log every step; evaluated and saved every 4 steps; the best checkpoint (the lower
#: eval loss: checkpoint-4, measured) loaded at the end
WATCHED = dict(logging_steps=1, eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=4,
               load_best_model_at_end=True, per_device_eval_batch_size=8)


def watched(cls, name, resume=None):
    """A grad-mode run of ``cls`` (dropout on) under WATCHED: what it trained, logged, evaluated and predicted."""
    kept = Trained()
    t = cls(gpt2(True), targs(name, **WATCHED), train_dataset=Tokens(), eval_dataset=Held(), callbacks=[kept])
    t.train(resume_from_checkpoint=resume)
    return {"trained": kept.model, "final": state(t.model), "log": logged(t),
            "best": (os.path.basename(t.state.best_model_checkpoint), t.state.best_metric),
            "evaluate": t.evaluate()["eval_loss"], "predict": predicted(t)}


if phase == "run":
    # ParamSync at LocalSGD's settings against LocalSGD: one instance, re-entered for a second epoch; K = 3
    # and evaluated after each block (the prepared model, gather_for_metrics)
    for name, cls in (("localsgd", LocalSGD), ("paramsync", ParamSync)):
        acc, m, opt = prepared()
        held = acc.prepare(DataLoader(HELD, batch_size=4))
        sync = cls(accelerator=acc, model=m, local_sgd_steps=3, enabled=True)
        if cls is ParamSync:
            acc.register_for_checkpointing(sync)
        res[f"{name}_evals"] = []
        for epoch in range(2):  # ParamSync saves after call 10 (syncs at 3, 6, 7 = the block's end, 9, 12)
            with sync:
                train(acc, m, opt, sync, range(7 * epoch, 7 * epoch + 7), save_at=9 if cls is ParamSync else None,
                      save_dir=os.path.join(out, "ckpt-plain"))
            res[f"{name}_evals"].append(evaluate(acc, m, held))
        res[name] = state(acc.unwrap_model(m))
    # LocalSGD's documented loop: accelerator.accumulate (2 micro-batches) inside the block, clipping at the sync
    # step; K = 4 calls (micro-batches)
    for name, cls in (("localsgd_ga", LocalSGD), ("paramsync_ga", ParamSync)):
        acc, m, opt = prepared(gradient_accumulation_steps=2)
        norms = []
        with cls(accelerator=acc, model=m, local_sgd_steps=4, enabled=True) as sync:
            for step in range(12):
                with acc.accumulate(m):
                    x, y = data(step)
                    acc.backward(nn.functional.mse_loss(m(x), y))
                    if acc.sync_gradients:
                        norms.append(float(acc.clip_grad_norm_(m.parameters(), 0.5)))
                    opt.step()
                    opt.zero_grad()
                sync.step()
        res[name] = state(acc.unwrap_model(m))
        res[f"{name}_norms"] = norms
    try:
        ParamSync(acc, m, config={"distributed": {"backend": "mpi"}})
    except Exception as e:
        res["refusal_sync"] = f"{type(e).__name__}: {e}"
    # distkit's own loop in param mode with the extras, 12 steps ...
    dk = distkit.init({"distributed": {"reduce_type": "param", "param_sync_step": 4, **EXTRAS["distributed"]},
                       "param_outer_optimizer": OUTER, "output_dir": os.path.join(out, "own-sync")})
    m = mlp()
    m, opt = dk.setup(m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9))
    for step in range(12):
        x, y = data(step)
        dk.backward(nn.functional.mse_loss(m(x), y))
        dk.step()
    dk.finish()
    res["own"] = state(m)
    # ... and ParamSync with the same keys; save_state after call 6 (fragment 1's exchange in flight)
    acc, m, opt = prepared()
    sync = ParamSync(acc, m, local_sgd_steps=4, config=EXTRAS)
    acc.register_for_checkpointing(sync)
    with sync:
        train(acc, m, opt, sync, range(12), save_at=5, save_dir=os.path.join(out, "ckpt-extras"))
    res["extras"] = state(acc.unwrap_model(m))
    res["extras_syncs"] = sync.averager.num_syncs

    # DistkitTrainer, grad mode, against the Trainer's own DDP run (dropout on: the RNG streams must match too)
    # (logged every step, evaluated and saved at 4 and 8, the best loaded at the end, then evaluate() and predict())
    res["gpt2_init"] = state(gpt2(True))
    res["watched_ddp"] = watched(Trainer, "plain")
    res["trainer_ddp"] = res["watched_ddp"]["trained"]
    res["watched_grad"] = watched(DistkitTrainer, "grad")
    res["trainer_grad"] = res["watched_grad"]["trained"]
    # with gradient accumulation: the micro-batches before the last one inside the Session's no_sync
    for name, cls in (("ddp", Trainer), ("grad", DistkitTrainer)):
        t = cls(gpt2(True), targs(f"{name}-ga", max_steps=4, gradient_accumulation_steps=2, logging_steps=1),
                train_dataset=Tokens())
        t.train()
        res[f"trainer_{name}_ga"] = state(t.model)
        res[f"trainer_{name}_ga_log"] = logged(t)
        # bf16=True (Accelerate's autocast around forward), evaluated after step 2
        t = cls(gpt2(True), targs(f"{name}-bf16", max_steps=4, bf16=True, logging_steps=1, eval_strategy="steps",
                                  eval_steps=2, per_device_eval_batch_size=8),
                train_dataset=Tokens(), eval_dataset=Held())
        t.train()
        res[f"trainer_{name}_bf16"] = state(t.model)
        res[f"trainer_{name}_bf16_log"] = logged(t)
    # each refusal, caught here (uncaught: test_refusals_are_one_line_exit_2_on_every_rank): its error,
    # and whether anything was written to its output dir
    res["refusals"] = {}
    for name, dk_cfg, kw in REFUSED:
        try:
            DistkitTrainer(gpt2(True), targs(f"refused-{name}", **kw), train_dataset=Tokens(), distkit=dk_cfg)
            res["refusals"][name] = ("not refused", None)
        except Exception as e:
            res["refusals"][name] = (f"{type(e).__name__}: {e}", os.path.exists(os.path.join(out, f"refused-{name}")))
    # param mode with every extra, saving after step 4, recording the batches this rank drew and the RNG state at
    # each forward (dropout's masks)
    seen, rngs = [], []
    t = param_trainer("param", save_strategy="steps", save_steps=4)
    t.data_collator = recorder(seen)
    hook = t.model.register_forward_pre_hook(lambda *_: rngs.append(torch.get_rng_state()))
    t.train()
    hook.remove()
    res["trainer_param"] = state(t.model)
    res["trainer_syncs"] = t.dk._strategy.averager.num_syncs
    res["trainer_in_flight"] = len(torch.load(os.path.join(out, "param", "checkpoint-4", "distkit", f"rank-{rank:05d}.pt"),
                                              weights_only=False)["distkit"]["averager"].get("in_flight", []))
    # distkit's own loop on those batches (the Trainer's clipping: max_grad_norm 1.0)
    dk = distkit.init({**PARAM, "gradient_clip": 1.0, "output_dir": os.path.join(out, "own-trainer")})
    m = gpt2(True)
    m, opt = dk.setup(m, sgd(m)[0])
    m.train()
    assert len(rngs) == 8
    for batch, rng in zip(seen, rngs):  # (the loader may have fetched one batch ahead)
        torch.set_rng_state(rng)  # the masks the Trainer's step drew
        dk.backward(m(**batch).loss)
        dk.step()
    dk.finish()
    res["trainer_own"] = state(m)
    # param mode (every extra, no dropout) with the Trainer's gradient_accumulation_steps 2, its clipping
    # (max_grad_norm 0.6: below most steps' norms, measured 0.54 to 0.75) and its default schedule (linear decay,
    # stepped every step), a log every step; then predict() on the held-out set (8 samples per rank)
    seen = []
    m = gpt2(False)
    t = DistkitTrainer(m, targs("param-ga", max_steps=4, gradient_accumulation_steps=2, max_grad_norm=0.6,
                                logging_steps=1, per_device_eval_batch_size=8),
                       train_dataset=Tokens(), optimizers=(sgd(m)[0], None), distkit=PARAM)
    t.model_accepts_loss_kwargs = False
    t.data_collator = recorder(seen)
    t.train()
    res["ga_param"] = state(t.model)
    res["ga_log"] = logged(t)
    res["ga_predict"] = predicted(t)
    # ... and distkit's own loop on those batches: the Trainer's loss / 2 per micro-batch, its clipping and schedule
    dk = distkit.init({**PARAM, "output_dir": os.path.join(out, "own-ga")})
    dk.set_accumulation(2)
    m = gpt2(False)
    m, opt = dk.setup(m, sgd(m)[0])
    sched = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=4)
    m.train()
    res["ga_own_steps"] = []
    for k in range(4):
        total = torch.tensor(0.0)
        for i, batch in enumerate(seen[2 * k:2 * k + 2]):
            with dk.no_sync() if i == 0 else contextlib.nullcontext():
                loss = m(**batch).loss / 2
                dk.backward(loss)
            total += loss.detach()
        norm = dk.clip_grad_norm(0.6)
        lr = sched.get_last_lr()[0]
        dk.step()
        sched.step()
        res["ga_own_steps"].append((total, norm, lr))
    dk.finish()
    res["ga_own"] = state(m)
    m.eval()
    with torch.no_grad():  # this rank's half of the held-out set, as predict() gave it to this rank
        res["ga_own_logits"] = m(input_ids=Held.ids[8 * rank:8 * rank + 8]).logits
    # load_best_model_at_end in param mode (H = 5), evaluated and saved every 6 steps: never at a sync; plain
    # averaging (the issue's setup), then with the outer optimizer (whose final sync must come before the load)
    res["best"] = {}
    for name, extra in (("best", {}), ("best-outer", {"param_outer_optimizer": OUTER})):
        m = gpt2(False)
        t = DistkitTrainer(m, targs(name, max_steps=24, eval_strategy="steps", eval_steps=6, save_strategy="steps",
                                    save_steps=6, load_best_model_at_end=True, per_device_eval_batch_size=4),
                           train_dataset=Tokens(), eval_dataset=Held(), optimizers=sgd(m),
                           distkit={"distributed": {"reduce_type": "param", "param_sync_step": 5}, **extra})
        t.train()
        res["best"][name] = {"metric": t.state.best_metric, "checkpoint": t.state.best_model_checkpoint,
                             "evals": {h["step"]: h["eval_loss"] for h in t.state.log_history if "eval_loss" in h},
                             "model": state(t.model), "evaluate": t.evaluate()["eval_loss"]}

    # examples/hf_local_sgd.py as converted, then with LocalSGD back in, then with distkit's extras from ++keys
    spec = importlib.util.spec_from_file_location("hf_local_sgd", example)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    converted = ex.ParamSync
    m, res["example_accuracy"] = ex.main(["--cpu", "--local_sgd_steps", "2"])
    res["example_paramsync"] = state(m)
    ex.ParamSync = lambda config=None, **kw: LocalSGD(**kw)  # the example before its conversion
    m, _ = ex.main(["--cpu", "--local_sgd_steps", "2"])
    res["example_localsgd"] = state(m)
    ex.ParamSync = converted
    m, _ = ex.main(["--cpu", "--local_sgd_steps", "2", "--gradient_accumulation_steps", "2",
                    "++param_outer_optimizer", repr(OUTER), "++distributed.param_sync_compression", "int8"])
    res["example_extras"] = state(m)
else:
    # new processes: each run resumed from its checkpoint
    acc, m, opt = prepared()
    sync = ParamSync(acc, m, local_sgd_steps=3)
    acc.register_for_checkpointing(sync)
    acc.load_state(os.path.join(out, "ckpt-plain"))
    res["plain_num_steps"] = sync.num_steps
    with sync:
        train(acc, m, opt, sync, range(10, 14))
    res["paramsync"] = state(acc.unwrap_model(m))
    acc, m, opt = prepared()
    sync = ParamSync(acc, m, local_sgd_steps=4, config=EXTRAS)
    acc.register_for_checkpointing(sync)
    acc.load_state(os.path.join(out, "ckpt-extras"))
    res["in_flight"] = len(sync.averager._in_flight)
    with sync:
        train(acc, m, opt, sync, range(6, 12))
    res["extras"] = state(acc.unwrap_model(m))
    t = param_trainer("resumed")
    t.train(resume_from_checkpoint=os.path.join(out, "param", "checkpoint-4"))
    res["trainer_param"] = state(t.model)
    res["trainer_steps"] = t.state.global_step
    # grad mode (dropout on), resumed from the uninterrupted run's checkpoint-4
    res["watched_grad"] = watched(DistkitTrainer, "grad-resumed", resume=os.path.join(out, "grad", "checkpoint-4"))
torch.save(res, os.path.join(out, f"{phase}-{rank}.pt"))
'''


def _job(out: Path, phase: str) -> list[dict[str, Any]]:
    """Run JOB's ``phase`` on 2 ranks under torchrun; each rank's results."""
    script = out / "job.py"
    script.write_text(JOB)
    ok(run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", "0", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "localhost:0", str(script), str(out), phase, str(EXAMPLE)], timeout=300))
    return [torch.load(out / f"{phase}-{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("hf")
    return out, _job(out, "run")


@pytest.fixture(scope="module")
def resumed(job: tuple[Path, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return _job(job[0], "resume")


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def logs_differ(a: list[dict[str, float]], b: list[dict[str, float]]) -> float:
    """The largest difference of two ``log_history`` lists (timings left out), entry by entry; inf where their
    entries or keys differ (a metric one of them logs and the other does not)."""
    if len(a) != len(b) or any(x.keys() != y.keys() for x, y in zip(a, b)):
        return float("inf")
    return max(abs(x[k] - y[k]) for x, y in zip(a, b) for k in x)


def test_param_sync_is_local_sgd_bit_for_bit(job: tuple[Path, list[dict[str, Any]]]) -> None:
    ranks = job[1]
    for r in ranks:
        assert identical(r["paramsync"], r["localsgd"])
        assert identical(r["example_paramsync"], r["example_localsgd"])  # Accelerate's example, converted
        assert r["example_accuracy"]["accuracy"] >= 0.0
    a, b = ranks[0]["paramsync"], ranks[1]["paramsync"]
    # the last sync made the parameters equal; the BatchNorm statistics stay each rank's own (as LocalSGD leaves them)
    assert all(torch.equal(a[k], b[k]) for k in a if "running" not in k)
    assert not torch.equal(a["1.running_mean"], b["1.running_mean"])
    assert "ConfigError" in ranks[0]["refusal_sync"] and "distributed.backend must be 'ddp'" in ranks[0]["refusal_sync"]
    for r in ranks:
        # evaluated after each block with the prepared model and gather_for_metrics: LocalSGD's predictions (all 14
        # held-out samples, the padding dropped) and loss
        for (preds, loss), (ref, ref_loss) in zip(r["paramsync_evals"], r["localsgd_evals"], strict=True):
            assert preds.shape == (14, 1) and torch.equal(preds, ref) and loss == ref_loss, (loss, ref_loss)
        # accelerator.accumulate (2 micro-batches) + clip_grad_norm_ at 0.5 inside the block: LocalSGD's model, and
        # its 6 pre-clip norms (all above 0.5: every step clipped)
        assert identical(r["paramsync_ga"], r["localsgd_ga"]), max_diff(r["paramsync_ga"], r["localsgd_ga"])
        norms = r["paramsync_ga_norms"]
        assert norms == r["localsgd_ga_norms"] and len(norms) == 6 and min(norms) > 0.5, norms
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ranks[0]["paramsync_evals"], ranks[1]["paramsync_evals"]))


def test_param_sync_extras_equal_distkits_own_loop(job: tuple[Path, list[dict[str, Any]]]) -> None:
    ranks = job[1]
    for r in ranks:
        assert identical(r["extras"], r["own"]), max_diff(r["extras"], r["own"])
        # 6 fragment syncs in 12 steps (fragment 1 at 2, 6, 10; fragment 0 at 4, 8, 12), and the final one
        assert r["extras_syncs"] == 7
    assert identical(ranks[0]["extras"], ranks[1]["extras"])  # parameters and BatchNorm statistics averaged
    # the example with the outer optimizer and int8 from ++keys: a different model, the same on both ranks
    assert identical(ranks[0]["example_extras"], ranks[1]["example_extras"])
    assert not identical(ranks[0]["example_extras"], ranks[0]["example_paramsync"])


def test_save_state_mid_period_resumes_bit_for_bit(job: tuple[Path, list[dict[str, Any]]],
                                                   resumed: list[dict[str, Any]]) -> None:
    out, ranks = job
    for r, again in zip(ranks, resumed, strict=True):
        assert again["plain_num_steps"] == 10 and again["in_flight"] == 1
        assert identical(again["paramsync"], r["paramsync"]), max_diff(again["paramsync"], r["paramsync"])
        assert identical(again["extras"], r["extras"]), max_diff(again["extras"], r["extras"])
    # the ranks really differed at the save: rank 0's weights alone (what Accelerate keeps) would not resume
    files = [torch.load(out / "ckpt-plain" / "distkit_param_sync" / f"rank-{r:05d}.pt", weights_only=False)
             for r in (0, 1)]
    assert max_diff(files[0]["models"][0], files[1]["models"][0]) > 1e-4


def test_distkit_trainer_grad_mode_equals_the_trainers_ddp(job: tuple[Path, list[dict[str, Any]]]) -> None:
    ranks = job[1]
    for r in ranks:
        assert max_diff(r["trainer_grad"], r["trainer_ddp"]) <= GRAD_TOL
        assert max_diff(r["trainer_grad_ga"], r["trainer_ddp_ga"]) <= GRAD_TOL  # gradient_accumulation_steps 2
        assert logs_differ(r["trainer_grad_ga_log"], r["trainer_ddp_ga_log"]) <= GRAD_TOL
        assert max_diff(r["trainer_grad"], r["gpt2_init"]) > 1e-3  # (it trained)
        # the same runs, watched: log_history (every step's loss, the mean over the ranks, grad_norm and
        # learning_rate; eval_loss at steps 4 and 8; train_loss), and no metric the Trainer's DDP run does not log
        dk, ddp = r["watched_grad"], r["watched_ddp"]
        assert logs_differ(dk["log"], ddp["log"]) <= GRAD_TOL, (dk["log"], ddp["log"])
        assert [h["step"] for h in dk["log"] if "loss" in h] == list(range(1, 9))
        assert [h["step"] for h in dk["log"] if "eval_loss" in h] == [4, 8]
        # load_best_model_at_end: the same best checkpoint (the lower eval loss: step 4, not the last) and metric,
        # loaded: the model it ends with, which evaluate() (after train()) and predict() see
        assert dk["best"][0] == ddp["best"][0] == "checkpoint-4" and abs(dk["best"][1] - ddp["best"][1]) <= GRAD_TOL
        assert max_diff(dk["final"], ddp["final"]) <= GRAD_TOL
        assert max_diff(dk["final"], dk["trained"]) > 1e-4  # (the best model is not the trained one)
        assert abs(dk["evaluate"] - ddp["evaluate"]) <= GRAD_TOL and dk["evaluate"] == dk["best"][1]
        assert dk["predict"][0].shape == (16, 32, 64)  # every held-out sample's logits, gathered
        assert max_diff({"logits": dk["predict"][0]}, {"logits": ddp["predict"][0]}) <= GRAD_TOL
        assert abs(dk["predict"][1] - ddp["predict"][1]) <= GRAD_TOL
        # bf16=True: Accelerate's autocast around forward from the first step (it was off, until the first
        # evaluation switched it on), evaluated after step 2
        assert max_diff(r["trainer_grad_bf16"], r["trainer_ddp_bf16"]) <= GRAD_TOL
        assert logs_differ(r["trainer_grad_bf16_log"], r["trainer_ddp_bf16_log"]) <= GRAD_TOL
        # (the first step's loss in bf16 is not the float32 one: autocast was on from the start)
        assert r["trainer_grad_bf16_log"][0]["loss"] != dk["log"][0]["loss"]
    assert identical(ranks[0]["watched_grad"]["final"], ranks[1]["watched_grad"]["final"])  # one model everywhere


def test_distkit_trainer_grad_mode_resumes_where_it_ended_with_dropout(job: tuple[Path, list[dict[str, Any]]],
                                                                       resumed: list[dict[str, Any]]) -> None:
    """Grad mode, dropout on: train(resume_from_checkpoint=checkpoint-4) in new processes (each rank's RNG state
    restored) trains, logs, evaluates, loads the best checkpoint and predicts as the uninterrupted run, bit for bit
    (train_loss, the mean over the steps of this call, left out: the Trainer's own resume does the same)."""
    for r, again in zip(job[1], resumed, strict=True):
        run, res = r["watched_grad"], again["watched_grad"]
        assert identical(res["trained"], run["trained"]), max_diff(res["trained"], run["trained"])
        drop = [{k: v for k, v in h.items() if k != "train_loss"} for h in run["log"]]
        assert [{k: v for k, v in h.items() if k != "train_loss"} for h in res["log"]] == drop
        assert res["best"] == run["best"] and identical(res["final"], run["final"])
        assert res["evaluate"] == run["evaluate"] and torch.equal(res["predict"][0], run["predict"][0])


#: each refusal's text, as a rank catches it: the fix it names
REFUSAL_TEXT = {
    "mpi": "UnsupportedCombination: DistkitTrainer runs distkit's ddp engine (grad or param mode), not 'mpi': remove "
           "distributed.backend, or use distkit's own loop (distkit.init) or distkit train",
    "horovod": "UnsupportedCombination: DistkitTrainer runs distkit's ddp engine (grad or param mode), not 'horovod': "
               "remove distributed.backend, or use distkit's own loop (distkit.init) or distkit train",
    "fsdp": "UnsupportedCombination: DistkitTrainer runs distkit's ddp engine (grad or param mode), not 'fsdp': remove "
            "distributed.backend, or use transformers.Trainer with TrainingArguments(fsdp=...)",
    "deepspeed": "UnsupportedCombination: DistkitTrainer runs distkit's ddp engine (grad or param mode), not "
                 "'deepspeed': remove distributed.backend, or use transformers.Trainer with "
                 "TrainingArguments(deepspeed=...)",
    "fp16": "UnsupportedCombination: DistkitTrainer replaces the Trainer's DDP and optimizer step: remove fp16 from "
            "TrainingArguments (bf16=True works), or use transformers.Trainer for fp16",
}


def test_distkit_trainer_refusals_name_the_fix_before_writing_anything(job: tuple[Path, list[dict[str, Any]]]) -> None:
    """Issue 57 item 5: every engine but ddp (each with what to use instead) and fp16, refused on every rank before the
    Trainer's constructor runs: the output dir is never created."""
    for r in job[1]:
        assert r["refusals"] == {name: (text, False) for name, text in REFUSAL_TEXT.items()}, r["refusals"]


def test_distkit_trainer_param_mode_equals_own_loop_and_resumes(job: tuple[Path, list[dict[str, Any]]],
                                                                resumed: list[dict[str, Any]]) -> None:
    out, ranks = job
    for r, again in zip(ranks, resumed, strict=True):
        # 5 fragment syncs (fragment 1 at 1, 4, 7; fragment 0 at 3, 6) and train()'s final one; one in flight saved
        assert r["trainer_syncs"] == 6 and r["trainer_in_flight"] == 1
        assert identical(r["trainer_param"], r["trainer_own"]), max_diff(r["trainer_param"], r["trainer_own"])
        assert again["trainer_steps"] == 8
        assert identical(again["trainer_param"], r["trainer_param"]), max_diff(again["trainer_param"], r["trainer_param"])
    assert identical(ranks[0]["trainer_param"], ranks[1]["trainer_param"])
    models = [torch.load(out / "param" / "checkpoint-4" / "distkit" / f"rank-{r:05d}.pt", weights_only=False)["model"]
              for r in (0, 1)]
    assert max_diff(models[0], models[1]) > 1e-4  # mid-period: each rank's own state was needed


def test_distkit_trainer_param_mode_accumulation_schedule_log_and_predict_equal_own_loop(
        job: tuple[Path, list[dict[str, Any]]]) -> None:
    """Param mode (outer optimizer, 2 fragments, int8, overlap 1) with gradient_accumulation_steps 2, clipping at
    max_grad_norm 0.6 and the Trainer's default schedule (linear decay, stepped every step) against distkit's own
    loop on the batches the Trainer drew (its loss / 2, dk.clip_grad_norm, transformers' get_scheduler): the
    final model; log_history every step: the loss (each rank's micro-batch losses summed, the mean over the
    ranks), this rank's grad_norm, the learning rate, train_loss; predict()'s logits: the own model's, each rank's
    half of the held-out set. All bit for bit."""
    ranks = job[1]
    own = [r["ga_own_steps"] for r in ranks]
    for r in ranks:
        assert identical(r["ga_param"], r["ga_own"]), max_diff(r["ga_param"], r["ga_own"])
        steps = [h for h in r["ga_log"] if "loss" in h]
        assert [h["step"] for h in steps] == [1, 2, 3, 4]
        for k, h in enumerate(steps):
            assert h["loss"] == torch.stack([own[0][k][0], own[1][k][0]]).mean().item(), (k, h)
            assert (h["grad_norm"], h["learning_rate"]) == r["ga_own_steps"][k][1:], (k, h)
        assert [h["learning_rate"] for h in steps] == pytest.approx([0.05, 0.0375, 0.025, 0.0125])
        assert sum(h["grad_norm"] > 0.6 for h in steps) >= 2  # (clipping acted)
        assert r["ga_log"][-1]["train_loss"] == sum([h["loss"] for h in steps] + [0.0]) / 4
    assert ranks[0]["ga_log"] != ranks[1]["ga_log"]  # (each rank's own grad_norm)
    logits = torch.cat([ranks[0]["ga_own_logits"], ranks[1]["ga_own_logits"]])
    for r in ranks:
        assert torch.equal(r["ga_predict"][0], logits)


@pytest.mark.parametrize("name", ["best", "best-outer"])
def test_load_best_model_at_end_in_param_mode_is_the_evaluated_model(job: tuple[Path, list[dict[str, Any]]],
                                                                      name: str) -> None:
    """Issue 57 item 2: param_sync_step 5, evaluated and saved every 6 steps (never at a sync: the ranks differ at
    every evaluation); plain averaging, and with the outer optimizer. In param mode the Trainer's evaluation sees
    the mean of the replicas, which is what checkpoint-N's model file holds: the best model, loaded at the end, is
    one model on every rank and its evaluate() is the recorded best_metric, exactly."""
    ranks = [r["best"][name] for r in job[1]]
    best = Path(ranks[0]["checkpoint"])
    step = int(best.name.rsplit("-", 1)[1])
    assert step != 24  # not the last evaluation: loading the best changed the model (measured: step 6)
    for r in ranks:
        assert Path(r["checkpoint"]) == best and sorted(r["evals"]) == [6, 12, 18, 24]
        assert r["metric"] == r["evals"][step] == min(r["evals"].values())
        assert r["evaluate"] == r["metric"], (r["evaluate"], r["metric"])
    assert identical(ranks[0]["model"], ranks[1]["model"])
    saved = load_file(best / "model.safetensors")
    own = [torch.load(best / "distkit" / f"rank-{r:05d}.pt", weights_only=False)["model"] for r in (0, 1)]
    assert max_diff(own[0], own[1]) > 1e-4  # the replicas differed at the best step
    assert set(own[0]) - set(saved) <= {"lm_head.weight"}  # (tied to the embedding: saved once)
    for k, v in saved.items():
        assert torch.equal(v, (own[0][k] + own[1][k]) / 2), k  # the checkpoint: the mean of the replicas
        assert torch.equal(ranks[0]["model"][k], v), k  # what every rank ends with


REFUSE = r'''
import argparse
from distkit.hf import DistkitTrainer  # under mpirun without MASTER_ADDR: refused here, before TrainingArguments
import distkit
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("out")
distkit.add_arguments(parser)
args = parser.parse_args()
targs = TrainingArguments(output_dir=args.out, use_cpu=True, report_to=[], disable_tqdm=True)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8, bos_token_id=0,
                                   eos_token_id=0))
DistkitTrainer(model, targs, distkit=args)
print("not refused")
'''
#: one rank under a launcher: its stdout, stderr and exit status into files named by its rank, and exit 0 (a launcher
#: stops the other ranks once one has failed: each rank's own line and status are what is asserted)
RANK_SH = 'r=${RANK:-$OMPI_COMM_WORLD_RANK}; "$@" >"$LOGS/out-$r" 2>"$LOGS/err-$r"; echo $? >"$LOGS/rc-$r"\n'
NOT_DDP = ("distkit: error: DistkitTrainer runs distkit's ddp engine (grad or param mode), not '{}': remove "
           "distributed.backend, or use distkit's own loop (distkit.init) or distkit train")
NO_MASTER_ADDR = ("distkit: error: DistkitTrainer and ParamSync run on Accelerate's torch.distributed group, which "
                  "starts from MASTER_ADDR and MASTER_PORT, and mpirun (openmpi) gave its 2 ranks no MASTER_ADDR: "
                  "launch with torchrun --nproc_per_node 2 (or accelerate launch), or export both to every rank "
                  "(mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<a free port> ...)")


def test_refusals_are_one_line_exit_2_on_every_rank(tmp_path: Path) -> None:
    """Issue 57 item 5, the three launch paths at once: under torchrun (++distributed.backend mpi) each rank; under
    --nprocs (++distributed.backend horovod) the one process that would start the ranks; under mpirun with no
    MASTER_ADDR (Accelerate's TrainingArguments would die in a traceback) each rank, at ``import distkit.hf``. Each:
    stderr exactly one ``distkit: error:`` line naming the fix, exit 2, nothing on stdout, no output dir."""
    script, wrap = tmp_path / "refuse.py", tmp_path / "rank.sh"
    script.write_text(REFUSE)
    wrap.write_text(RANK_SH)
    py = [sys.executable, str(script)]
    launches = {
        "torchrun": [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", "0", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", "localhost:0", "--no-python", "sh", str(wrap), *py, "{out}",
                     "++distributed.backend", "mpi"],
        "mpirun": [str(BIN / "mpirun"), "-np", "2", "--oversubscribe", "--bind-to", "none", "sh", str(wrap), *py,
                   "{out}"],
        "nprocs": [*py, "{out}", "--nprocs", "2", "++distributed.backend", "horovod"],
    }

    def launch(name: str) -> Any:
        logs = tmp_path / name
        logs.mkdir()
        cmd = [a.replace("{out}", str(tmp_path / f"out-{name}")) for a in launches[name]]
        return run(cmd, timeout=150, LOGS=str(logs))

    with ThreadPoolExecutor(len(launches)) as pool:  # (started together: each is mostly imports)
        done = dict(zip(launches, pool.map(launch, launches), strict=True))
    for name, line in (("torchrun", NOT_DDP.format("mpi")), ("mpirun", NO_MASTER_ADDR)):
        ok(done[name])  # (the wrapper exits 0; the ranks' own statuses are in the files)
        for r in (0, 1):
            rank = [(tmp_path / name / f"{what}-{r}").read_text() for what in ("rc", "out", "err")]
            assert rank == ["2\n", "", line + "\n"], (name, r, rank)
    nprocs = done["nprocs"]
    assert (nprocs.returncode, nprocs.stdout, nprocs.stderr) == (2, "", NOT_DDP.format("horovod") + "\n"), nprocs
    assert not any((tmp_path / f"out-{name}").exists() for name in launches)
