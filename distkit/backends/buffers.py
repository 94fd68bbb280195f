"""DDP's rule for a model's buffers (BatchNorm statistics), for the engines that do not wrap the model in DDP.

Read from torch's ``DistributedDataParallel`` (``_pre_forward``/``_post_forward``, ``require_forward_param_sync``):
the leader's buffers (rank 0's; the replica group's first rank's with replica groups) replace every other rank's
before a forward through the wrapper when it is the model's first forward, or when the forward before it was a
synchronising training forward: autograd enabled and outside ``no_sync``. Whether the model is in ``train()`` or
``eval()`` mode plays no part. So, as under DDP:

- every training forward of a plain loop starts from the leader's statistics;
- the first evaluation forward after training steps (``model.eval()`` under ``torch.no_grad()``) takes them too,
  and the later ones of the same evaluation do not (each rank evaluates with what it then holds);
- the first training forward after an evaluation under ``no_grad`` does not;
- with accumulation, the micro-step after a ``no_sync`` one does not.

The mpi, Horovod and DeepSpeed engines synced before training-mode forwards only: a BatchNorm model's
per-epoch evaluation (pytorch/examples imagenet) then gave other accuracies than DDP (issue 36).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


class DDPBufferRule:
    """Hooks on ``model`` that call ``sync()`` (a collective over the ranks that reduce gradients together) before
    each forward DDP would broadcast buffers before (module docstring). ``outside_no_sync()`` says whether the
    engine is outside ``no_sync`` now. Collective: every rank of the group must run the same forwards with the
    same autograd and ``no_sync`` state, as under DDP."""

    def __init__(self, model: nn.Module, sync: Callable[[], None], outside_no_sync: Callable[[], bool]) -> None:
        self._model, self._sync, self._outside_no_sync = model, sync, outside_no_sync
        self._due = True  # DDP's require_forward_param_sync starts True: the first forward syncs
        #: forwards of the model in progress: a forward inside another (a Lightning step redirected through the
        #: model's forward that calls ``self(x)``) is no forward through DDP's wrapper, only the outer one is
        self._depth = 0
        self._handles = [model.register_forward_pre_hook(self._before),
                         model.register_forward_hook(self._after, always_call=True)]

    def __deepcopy__(self, memo: dict[int, Any]) -> "DDPBufferRule":
        # A deep copy of the model (an EMA's AveragedModel, copy.deepcopy(model)) copies its hooks: they stay bound
        # to this rule and do nothing for the copy (its forward is not the model's; under DDP it is no forward
        # through the wrapper), instead of copying the engine behind ``sync``.
        return self

    def _before(self, module: nn.Module, args: Any) -> None:
        if module is self._model:
            if self._depth == 0 and self._due:
                self._sync()
            self._depth += 1

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        if module is self._model:
            self._depth = max(0, self._depth - 1)
            if self._depth == 0:
                self._due = torch.is_grad_enabled() and self._outside_no_sync()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
