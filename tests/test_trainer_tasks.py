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


# A Hugging Face classifier (transformers' BertForSequenceClassification, 1 layer x 16 wide) on dict batches
# {"input_ids", "labels"}: the loss is model(**batch).loss, the logits are model(**batch).logits. The label is
# whether the first token is in the upper half of the vocabulary: learnable, and partly learned after 6 steps.
HF_CLASSIFIER_CONFIG = '''
import torch
from transformers import BertConfig, BertForSequenceClassification

_VOCAB, _LEN = 16, 6


def model():
    cfg = BertConfig(vocab_size=_VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=_LEN, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, num_labels=2)
    return BertForSequenceClassification(cfg)


def _items(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, _VOCAB, (n, _LEN), generator=g)
    labels = (ids[:, 0] > _VOCAB // 2).long()
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


def dataset():
    return _items(128, 0), _items(50, 1)


optimizer = {"class": "adamw"}
learning_rate = 0.002
max_steps = 6
eval_every = 3
log_every = 3
batch_size = 8
progress_bar = False
'''

# The other way to report an accuracy: an eval_step returning it (the custom task asks for no metric itself).
EVAL_STEP = '''
def eval_step(model, batch):
    out = model(**batch)
    return out.loss, {"accuracy": (out.logits.argmax(-1) == batch["labels"]).float().mean()}
'''


def _accuracy_of_the_final_checkpoint(cfg: Path, out: Path) -> float:
    """The eval set's accuracy, computed here in one batch by the config's own model loaded from the run's
    final checkpoint (in eval mode, as distkit evaluates)."""
    import torch

    from distkit.config.loader import load_file

    keys = load_file(str(cfg))
    model = keys["model"]()
    model.load_state_dict(final_params(out))
    model.eval()
    _, items = keys["dataset"]()
    labels = torch.stack([item["labels"] for item in items])
    with torch.no_grad():
        logits = model(input_ids=torch.stack([item["input_ids"] for item in items])).logits
    return int((logits.argmax(-1) == labels).sum()) / len(items)


@pytest.mark.parametrize("how", ["metrics", "eval_step"])
def test_accuracy_of_dict_batches_lands_in_summary_and_metrics_2_ranks(tmp_path: Path, how: str) -> None:
    """Issue 22: ``metrics = ["accuracy"]`` on dict batches scores ``model(**batch).logits`` against
    ``batch["labels"]``; an eval_step's ``{"accuracy": ...}`` is kept too. Both reach summary.json's
    eval_accuracy and metrics.jsonl's eval records, equal to the accuracy of the final checkpoint."""
    cfg, out = tmp_path / "cls.py", tmp_path / "out"
    cfg.write_text(HF_CLASSIFIER_CONFIG + ("metrics = ['accuracy']\n" if how == "metrics" else EVAL_STEP))
    ok(distkit_cli("train", str(cfg), "--nprocs", "2", "++output_dir", str(out)))
    expected = _accuracy_of_the_final_checkpoint(cfg, out)
    assert 0.5 < expected < 1.0  # neither chance nor solved: a wrong count would show
    s = summary(out)
    assert (s["world_size"], s["steps"]) == (2, 6)
    # per-batch accuracies x batch sizes, summed over both ranks' slices: the exact count / 50
    assert s["eval_accuracy"] == expected
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert [r["step"] for r in evals] == [3, 6] and all(0.0 < r["eval_accuracy"] < 1.0 for r in evals)
    assert (evals[-1]["eval_accuracy"], evals[-1]["eval_loss"]) == (expected, s["eval_loss"])


def _no_logits_model() -> "torch.nn.Module":
    """A regression on dict batches whose output has a loss and no logits (its target: the batch's ``labels``
    or ``y``, whichever it has)."""
    import torch

    class Regressor(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x: torch.Tensor, **target: torch.Tensor) -> dict[str, torch.Tensor]:
            (y,) = target.values()
            return {"loss": ((self.lin(x).squeeze(-1) - y) ** 2).mean()}

    return Regressor()


@pytest.mark.parametrize("target_key", ["y", "labels"])
def test_accuracy_of_dict_batches_without_labels_or_logits_names_the_fix(tmp_path: Path, target_key: str) -> None:
    """The accuracy of a dict batch needs the batch's 'labels' and the output's logits: a UsageError (one line)
    names what is missing and the fix, at the evaluation."""
    import torch

    items = [{"x": torch.randn(3), target_key: torch.tensor(float(i % 2))} for i in range(24)]
    with pytest.raises(UsageError) as e:
        distkit.Trainer({"model": _no_logits_model, "dataset": lambda: (items[:16], items[16:]), "metrics": ["accuracy"],
                         "max_steps": 1, "batch_size": 8, "output_dir": str(tmp_path), "progress_bar": False}).fit()
    rule = ("metrics ['accuracy'] on a dict batch score the model output's logits against the batch's 'labels' "
            "(the Hugging Face convention), but ")
    fix = "or compute the metrics in eval_step = f(model, batch) -> (loss, {'accuracy': ...})"
    assert str(e.value) == rule + {
        "y": f"the batch has no 'labels' (its keys: x, y): add 'labels' to the dataset's items, {fix}",
        "labels": f"the model returned no logits (a dict): return them too (e.g. {{'loss': loss, 'logits': logits}}), {fix}",
    }[target_key]
