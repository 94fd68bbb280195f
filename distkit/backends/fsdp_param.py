"""Param mode on the fsdp engine: FSDP2 shards inside each replica group, and at a sync every rank averages its
own shards with the ranks that hold the same shards in the other groups (one copy of the model per link, as the
other engines' replica groups do). Its averager works on the local shards (``DTensor.to_local()``: views, so an
average written into them is the model); by name, for checkpoints, they are gathered whole inside the group."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distkit.sync.averager import ParamAverager
from distkit.sync.compression import codec_of

from .base import Strategy


class ShardAverager(ParamAverager):
    """A :class:`~distkit.sync.averager.ParamAverager` of a sharded model: its tensors are this rank's shards of the
    parameters (averaged over the cross group, the ranks holding the same shards), then the floating buffers
    (whole on every rank: over the group's ranks, then across the groups, :meth:`Strategy.average_parameters`'
    rule)."""

    def __init__(self, strategy: Strategy, params: list[tuple[str, nn.Parameter]],
                 buffers: list[tuple[str, torch.Tensor]], **kwargs: Any) -> None:
        self._params = params
        with torch.no_grad():  # (to_local under no_grad: the local tensor itself, no autograd view)
            shards = [p.to_local() for _, p in params]  # type: ignore[attr-defined]
        super().__init__(strategy, shards + [b for _, b in buffers],  # type: ignore[arg-type]
                         names=[n for n, _ in params] + [n for n, _ in buffers], **kwargs)

    def keep(self, tensors: list[torch.Tensor]) -> None:
        """A kept module's sharded tensors (a copy of the model, :mod:`~distkit.backends.fsdp_copy`) by their local
        shards, averaged as the model's across the groups; its whole ones (buffers) as every engine's."""
        with torch.no_grad():
            for t in tensors:
                if hasattr(t, "to_local"):
                    self.extra_shards.append(t.to_local())  # type: ignore[attr-defined]
                else:
                    self.extra.append(t)

    def is_parameter(self, index: int) -> bool:
        return index < len(self._params)

    def _by_name(self, values: list[torch.Tensor], keep: bool = True) -> dict[str, torch.Tensor]:
        """Collective inside the replica group: ``values`` (one per averaged tensor, shards for the parameters)
        whole, by name; every rank joins the gathers, only ``keep`` takes copies."""
        from torch.distributed.tensor import DTensor

        out: dict[str, torch.Tensor] = {}
        for i, (name, v) in enumerate(zip(self.names or [], values, strict=True)):
            if i < len(self._params):
                p = self._params[i][1]
                v = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,  # type: ignore[attr-defined]
                                       shape=p.shape, stride=p.stride()).full_tensor()
            if keep:
                out[name] = v.detach().cpu().clone()
        return out

    def _from_name(self, by_name: dict[str, torch.Tensor], into: list[torch.Tensor]) -> None:
        """Whole tensors (every rank holds them) into ``into``: this rank's shards for the parameters (cut here,
        no communication)."""
        from torch.distributed.tensor import distribute_tensor

        for i, (name, t) in enumerate(zip(self.names or [], into, strict=True)):
            whole = by_name[name].to(t.device, t.dtype)
            if i < len(self._params):
                p = self._params[i][1]
                whole = distribute_tensor(whole.view(p.shape), p.device_mesh, p.placements,  # type: ignore[attr-defined]
                                          src_data_rank=None).to_local()
            t.copy_(whole.view_as(t))


def shard_averager(strategy: Strategy, module: nn.Module) -> ShardAverager:
    """The averager of ``module``'s sharded parameters and floating buffers, configured from
    ``strategy.cfg.distributed`` as every engine's (:func:`~distkit.backends.parts.param_averager`)."""
    d = strategy.cfg.distributed
    buffers = [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
    return ShardAverager(strategy, list(module.named_parameters()), buffers, sync_step=d.param_sync_step,
                         sync_time_diff=d.param_sync_time_diff, outer_optimizer=d.outer_optimizer,
                         fragments=d.param_sync_fragments, compression=codec_of(d),
                         error_feedback=d.param_sync_error_feedback, overlap=d.param_sync_overlap)
