"""Your model in `distkit train`: any batch structure, how the loss is computed, metrics that fit the task."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import distkit
from distkit.errors import UsageError

from conftest import distkit as distkit_cli, final_params, max_abs_diff, ok, summary

# A regression whose model takes a dict batch and returns {"loss": ...} (the Hugging Face convention).
DICT_CONFIG = '''
import torch
from torch import nn

class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x, y):
        pred = self.lin(x).squeeze(-1)
        return {"loss": ((pred - y) ** 2).mean(), "pred": pred}

def model():
    return Regressor()

def dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 3, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1
    items = [{"x": x[i], "y": y[i]} for i in range(256)]
    return items[:192], items[192:]

optimizer = {"class": "sgd"}
learning_rate = 0.05
max_steps = 20
log_every = 5
progress_bar = False
'''


def test_dict_batches_use_model_loss_and_report_no_accuracy_2_ranks_equal_1(tmp_path: Path) -> None:
    cfg = tmp_path / "reg.py"
    cfg.write_text(DICT_CONFIG)
    two, one = tmp_path / "two", tmp_path / "one"
    ok(distkit_cli("train", str(cfg), "--nprocs", "2", "++batch_size", "8", "++output_dir", str(two)))
    ok(distkit_cli("train", str(cfg), "++batch_size", "16", "++output_dir", str(one)))
    assert max_abs_diff(final_params(two), final_params(one)) <= 1e-5
    s = summary(two)
    assert "eval_accuracy" not in s and 0 < s["eval_loss"] < 10 and s["ranks_in_sync"]
    assert s["best_eval_loss"] == s["eval_loss"] and s["best_eval_step"] == 20
    losses = [json.loads(line)["loss"] for line in (two / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert losses[-1] < losses[0]  # it learned
    assert "accuracy" not in (two / "metrics.jsonl").read_text()


def _items(n: int) -> list[dict[str, object]]:
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return [{"inputs": x[i], "label": int(x[i].sum() > 0)} for i in range(n)]


def test_train_step_metrics_and_dataset_keys(tmp_path: Path) -> None:
    import torch

    def step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        logits = model(batch["inputs"])
        loss = torch.nn.functional.cross_entropy(logits, batch["label"])
        return loss, {"acc": float((logits.argmax(-1) == batch["label"]).float().mean())}

    summary = distkit.Trainer({"model": lambda: torch.nn.Linear(4, 2), "train_dataset": lambda: _items(96),
                               "eval_dataset": _items(32), "train_step": step, "max_steps": 6, "batch_size": 8,
                               "log_every": 3, "output_dir": str(tmp_path), "progress_bar": False}).fit()
    assert summary["steps"] == 6 and "eval_accuracy" not in summary
    assert 0.0 <= summary["eval_acc"] <= 1.0 and summary["eval_loss"] > 0  # eval uses train_step too
    logs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs if "acc" in r] == [3, 6]  # the step's metrics, averaged and logged


def test_metrics_key_and_bad_loss(tmp_path: Path) -> None:
    import torch

    data = [(torch.randn(4), int(i % 2)) for i in range(64)]
    s = distkit.Trainer({"model": lambda: torch.nn.Linear(4, 2), "dataset": lambda: (data[:48], data[48:]),
                         "metrics": ["accuracy"], "max_steps": 2, "batch_size": 8, "output_dir": str(tmp_path / "a"),
                         "progress_bar": False}).fit()
    assert 0.0 <= s["eval_accuracy"] <= 1.0  # asked for: reported
    with pytest.raises(UsageError, match="needs a scalar tensor"):
        distkit.Trainer({"model": lambda: torch.nn.Linear(4, 2), "dataset": lambda: data, "batch_size": 8,
                         "train_step": lambda m, b: m(b[0]), "max_steps": 1, "output_dir": str(tmp_path / "b"),
                         "progress_bar": False}).fit()


FAILING_METRIC_CONFIG = '''
import os
import torch

def model():
    return torch.nn.Linear(4, 2)

def dataset():
    g = torch.Generator().manual_seed(0)
    items = [(torch.randn(4, generator=g), i % 2) for i in range(96)]
    return items[:64], items[64:]

def wrong(outputs, targets):
    if os.environ.get("RANK") == "1":  # one rank only: the other must not wait for it forever
        return outputs.argmax(-1).eq(targets[:3]).float().mean()  # 8 vs 3: shapes do not broadcast
    return 0.5

metrics = [wrong]
max_steps = 4
batch_size = 8
progress_bar = False
'''


def test_a_failing_metric_names_itself_and_the_rank_and_ends_every_rank(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.py"
    cfg.write_text(FAILING_METRIC_CONFIG)
    res = distkit_cli("train", str(cfg), "--nprocs", "2", "++output_dir", str(tmp_path / "out"), timeout=120)
    assert res.returncode != 0
    assert "distkit: rank 1 failed: UsageError: metric 'wrong' failed on the model's outputs" in res.stderr, res.stderr
    # the spawner names rank 1 too, not rank 0, whose own error was only "connection closed by peer"
    assert "distkit: rank 1 failed (exit status 2); stopping the other ranks" in res.stderr, res.stderr
    assert "distkit: rank 0 failed (" not in res.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


def test_a_batch_that_cannot_move_to_the_device_is_named() -> None:
    import torch

    from distkit.data import to_device

    class Opaque:  # has a .to() that does not take a device
        def to(self, *args: object) -> None:
            raise TypeError("to() takes no device")

    batch = {"x": torch.ones(2), "meta": [Opaque()]}
    with pytest.raises(UsageError, match="batch item of type Opaque could not be moved to cpu.*TypeError: to"):
        to_device(batch, torch.device("cpu"))
