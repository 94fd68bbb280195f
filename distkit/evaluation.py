"""The loss (and metrics) of one batch, evaluation over ranks, and parameter checksums."""
from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Optional, Protocol

import torch
from torch import nn
from torch.utils.data import default_collate

from distkit.data import eval_slices, fetch, to_device
from distkit.errors import UsageError
from distkit.tasks import Task


class SessionView(Protocol):
    """What this module reads (and sets) of :class:`distkit.Session`, which has every member: typed by this
    protocol, the module does not import the Session (it sits below it).
    """

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Collective: every rank must call it, in the same order."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision's autocast context."""

    @property
    def device(self) -> torch.device:
        """This rank's device."""

    @property
    def forward_is_collective(self) -> bool:
        """A forward pass communicates (ZeRO-3): every rank must run each one."""

    @property
    def rank(self) -> int:
        """Global rank."""

    def unwrap(self, model: Optional[nn.Module] = None) -> nn.Module:
        """The plain module inside the engine's wrapper."""

    @property
    def world_size(self) -> int:
        """Ranks in the job."""


#: a batch's loss (a scalar tensor) and its metrics by name (floats or scalar tensors)
StepResult = tuple[torch.Tensor, dict[str, Any]]


def param_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over every parameter in ``named_parameters`` order, as fp32 bytes."""
    h = hashlib.sha256()
    for _, p in named:
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def batch_loss(task: Task, model: nn.Module, batch: Any, train: bool) -> StepResult:
    """The loss of ``batch`` and its metrics, in this order of precedence: the task's ``train_step``
    (``eval_step`` when not ``train``) returning ``loss`` or ``(loss, metrics)``; for a dict batch with
    no ``loss`` configured, the Hugging Face convention ``model(**batch).loss``; else
    ``loss(model(inputs), targets)``, with the task's metrics on the outputs when not ``train``.

    On a dict batch the task's metrics (when not ``train``) get the model output's ``logits`` (an attribute
    or a key, as in Hugging Face's ``ModelOutput``) as outputs and the batch's ``labels`` as targets, as
    they are: no shift (a causal LM whose labels are its inputs needs a metric that shifts, or an
    ``eval_step``) and every position counts (labels of -100, Hugging Face's ignore index, included). A
    batch without ``labels`` or an output without ``logits`` is a UsageError naming the fix."""
    step = task.train_step if train else task.eval_step
    if step is not None:
        out = step(model, batch)
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        if not isinstance(metrics, Mapping):
            raise UsageError(f"train_step/eval_step must return loss or (loss, metrics dict); the second item is a "
                             f"{type(metrics).__name__}")
        return loss, dict(metrics)
    if isinstance(batch, Mapping) and task.hf_loss:
        wanted = {} if train else task.metrics
        # Checked before the forward: without labels there is nothing to score, whatever the model returns.
        if wanted and "labels" not in batch:
            raise UsageError(f"{_hf_metrics_rule(wanted)}, but the batch has no 'labels' (its keys: "
                             f"{', '.join(map(str, batch))}): add 'labels' to the dataset's items, or compute the "
                             "metrics in eval_step = f(model, batch) -> (loss, {'accuracy': ...})")
        out = model(**batch)
        loss = _output_field(out, "loss")
        if loss is None:
            raise UsageError("a dict batch with no 'loss' configured uses the Hugging Face convention "
                             "model(**batch).loss, but the model returned no loss: include 'labels' in the batch, "
                             "or set loss = ... or train_step = ...")
        if not wanted:
            return loss, {}
        logits = _output_field(out, "logits")
        if logits is None:
            raise UsageError(f"{_hf_metrics_rule(wanted)}, but the model returned no logits (a "
                             f"{type(out).__name__}): return them too (e.g. {{'loss': loss, 'logits': logits}}), or "
                             "compute the metrics in eval_step = f(model, batch) -> (loss, {'accuracy': ...})")
        labels = batch["labels"]
        return loss, {name: _metric(name, fn, logits, labels) for name, fn in wanted.items()}
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise UsageError(f"a batch of type {type(batch).__name__} is not (inputs, targets): set train_step = "
                         "f(model, batch) -> loss, or make dataset items (inputs, targets)")
    x, y = batch
    out = model(x)
    loss = task.loss(out, y)
    metrics = {} if train else {name: _metric(name, fn, out, y) for name, fn in task.metrics.items()}
    return loss, metrics


def _output_field(out: Any, name: str) -> Any:
    """``out[name]`` for a mapping output (a dict, or Hugging Face's ``ModelOutput``, which is one), else the
    attribute ``name``; None when it has none."""
    return out.get(name) if isinstance(out, Mapping) else getattr(out, name, None)


def _hf_metrics_rule(metrics: Mapping[str, Any]) -> str:
    """The start of the UsageErrors of metrics on dict batches: which metrics, and what they score."""
    return (f"metrics {sorted(metrics)} on a dict batch score the model output's logits against the batch's 'labels' "
            "(the Hugging Face convention)")


def _metric(name: str, fn: Callable[[Any, Any], Any], outputs: Any, targets: Any) -> float:
    """One metric's value, or a UsageError naming the metric (a rank failure that ends every rank)."""
    try:
        value = fn(outputs, targets)
        return float(value)
    except Exception as e:
        raise UsageError(f"metric '{name}' failed on the model's outputs ({type(e).__name__}: {e}): 'metrics' "
                         "callables take (outputs, targets) and return a float; fix or remove it") from e


def batch_size_of(batch: Any) -> int:
    """Samples in ``batch``: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else \
        [getattr(batch, k) for k in getattr(batch, "__dataclass_fields__", {})]
    for v in values:
        n = batch_size_of(v) if isinstance(v, (torch.Tensor, Mapping, tuple, list)) else 0
        if n:
            return n
    return 1


def evaluate(s: SessionView, model: nn.Module, task: Task, batch_size: int) -> dict[str, float]:
    """Collective: ``{"eval_loss": ..., "eval_<metric>": ...}`` over the whole eval set, every rank a
    disjoint slice, each value the mean over samples; identical on every rank; {} without an eval set.
    Per-batch work is local; the totals are all-reduced once (metric names must agree across ranks)."""
    if task.eval is None:
        return {}
    bare = s.unwrap(model)
    bare.eval()
    collate: Callable[[list[Any]], Any] = task.collate_fn or default_collate  # fetch: tensor indexing when it can
    slices = list(eval_slices(len(task.eval), batch_size, s.rank, s.world_size))  # type: ignore[arg-type]
    n_forward = len(slices)
    if s.forward_is_collective:  # every rank runs as many forwards as the busiest one
        n_forward = int(s.all_reduce(torch.tensor([n_forward]), op="max").item())
    sums: dict[str, float] = {}
    count = 0
    with torch.no_grad(), s.autocast():
        for k in range(n_forward):
            idx = slices[k] if k < len(slices) else (slices[0] if slices else torch.arange(1))
            items = fetch(task.eval, idx) if task.collate_fn is None else collate([task.eval[int(i)] for i in idx])
            batch = to_device(items, s.device)
            loss, metrics = batch_loss(task, bare, batch, train=False)
            if k >= len(slices):  # padding forward on a repeated batch; not counted
                continue
            n = batch_size_of(batch)
            for name, value in {"loss": loss, **metrics}.items():
                sums[name] = sums.get(name, 0.0) + float(value) * n
            count += n
    bare.train()
    names = sorted(sums) or ["loss", *sorted(task.metrics)]
    totals = torch.tensor([sums.get(name, 0.0) for name in names] + [float(count)], dtype=torch.float64)
    s.all_reduce(totals, op="sum")
    n_total = max(float(totals[-1]), 1.0)
    return {f"eval_{name}": float(totals[i]) / n_total for i, name in enumerate(names)}
