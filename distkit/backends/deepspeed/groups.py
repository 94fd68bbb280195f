"""param mode for DeepSpeed (DeepSpeed has none): replica groups and the master averager.

The ranks are cut into replica groups of
``distributed.param_sync_group_size`` consecutive ranks. Each group is one DeepSpeed
data-parallel world (handed to DeepSpeed as a Megatron-style ``mpu``): inside it ZeRO
partitions and gradients are reduced as usual; the groups step independently, and every
``param_sync_step`` steps :class:`~distkit.sync.averager.ParamAverager` averages across
groups. What is averaged is the optimizer's fp32 *master* copy (ZeRO-1/2
``single_partition_of_fp32_groups``, ZeRO-3 ``fp32_partitioned_groups_flat``, the bf16
optimizer's ``fp32_groups_flat_partition``; the parameters themselves at stage 0 fp32),
over the ranks that hold the same partition in each group; the model's (bf16/fp16/fp32)
weights are then rewritten from it, so the next step starts from the average. Floating
buffers are averaged over all ranks. Optimizer moments stay local (as for DDP).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from distkit.sync.averager import ParamAverager, Reducer
from distkit.sync.replicas import ReplicaGroups


class EngineView(Reducer, Protocol):
    """What the param-mode averager of this module uses of the DeepSpeed engine
    (:class:`~distkit.backends.deepspeed.engine.DeepSpeedStrategy` has it): the sync code's collectives
    (:class:`~distkit.sync.averager.Reducer`) and the members below. The engine imports this module, never the
    other way round."""

    engine: Any  # deepspeed's DeepSpeedEngine
    mpu: Optional["_ReplicaGroups"]
    ft: Any  # fault-tolerant groups' FaultTolerance, else None
    world_size: int

    @property
    def device(self) -> torch.device:
        """The engine's device."""

    def unwrap(self, model: Any) -> nn.Module:
        """The plain module inside the engine."""

    def average_over(self, tensors: list[torch.Tensor], group: Any, size: int) -> None:
        """Collective over ``group`` (None: every rank) of ``size`` ranks: each tensor becomes its mean."""


class _ReplicaGroups:
    """A Megatron-style ``mpu`` for DeepSpeed: data parallel = this rank's replica group of
    ``size`` consecutive ranks; no tensor/pipeline parallelism. Creating it is collective."""

    def __init__(self, rank: int, world_size: int, size: int) -> None:
        self.rank, self.size = rank, size
        layout = ReplicaGroups(rank, world_size, size)
        self.index = layout.index              # which replica group
        self.position = layout.position        # rank inside the group = ZeRO partition id
        groups = [dist.new_group(ranks) for ranks in layout.groups()]
        cross = [dist.new_group(ranks) for ranks in layout.crosses()]
        singles = [dist.new_group([r]) for r in range(world_size)]
        self.dp_group, self.cross_group, self.single = groups[self.index], cross[self.position], singles[rank]
        self.cross_size = layout.count

    # data parallel
    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.size

    def get_data_parallel_rank(self) -> int:
        return self.position

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(range(self.index * self.size, (self.index + 1) * self.size))

    # model / tensor / pipeline parallel: one rank each
    def get_model_parallel_group(self) -> Any:
        return self.single

    get_tensor_model_parallel_group = get_model_parallel_group
    get_pipe_parallel_group = get_model_parallel_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_pipe_parallel_world_size = get_model_parallel_world_size
    get_pipeline_model_parallel_world_size = get_model_parallel_world_size

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_pipeline_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.rank


class _MasterAverager(ParamAverager):
    """ParamAverager whose tensors are optimizer master copies; after every sync the model's
    weights are rewritten from them (``refresh``), so the next step starts from the average.

    ``params``: the named model parameters the masters hold, or None when the masters are the
    parameters themselves (fp32 without ZeRO). Under ZeRO the masters are flat partitions, so the
    averager's state goes by name through DeepSpeed's own assembly (``safe_get/set_full_fp32_param``):
    the state is put in the masters' place for the time of the (collective) assembly."""

    def __init__(self, strategy: EngineView, masters: list[torch.Tensor], buffers: list[tuple[str, torch.Tensor]],
                 refresh: Any, params: Optional[list[tuple[str, nn.Parameter]]], **kwargs: Any) -> None:
        self._n_masters, self._refresh, self._ds, self._params = len(masters), refresh, strategy, params
        self._buffer_names = [n for n, _ in buffers]
        names = None if params is not None else [n for n, _ in strategy.unwrap(strategy.engine).named_parameters()] + self._buffer_names
        super().__init__(strategy, masters + [b for _, b in buffers], names=names, **kwargs)
        self.strategy = self  # type: ignore[assignment]  # average_parameters/all_reduce below

    @contextlib.contextmanager
    def _in_masters_place(self, values: Optional[list[torch.Tensor]]) -> Iterator[list[torch.Tensor]]:
        """``values`` copied into the masters (None: the masters as they are), restored on exit; yields the masters."""
        masters = self.tensors[:self._n_masters]
        saved = [m.detach().clone() for m in masters]
        try:
            with torch.no_grad():
                for m, v in zip(masters, values or [], strict=False):
                    m.copy_(v)
            yield masters
        finally:
            with torch.no_grad():
                for m, v in zip(masters, saved, strict=True):
                    m.copy_(v)

    def _by_name(self, values: list[torch.Tensor], keep: bool = True) -> dict[str, torch.Tensor]:
        if self._params is None:
            return super()._by_name(values, keep)
        from deepspeed.utils import safe_get_full_fp32_param  # type: ignore[import-untyped]

        n = self._n_masters
        out = {name: v.detach().cpu().clone() for name, v in zip(self._buffer_names, values[n:], strict=True)} if keep else {}
        with self._in_masters_place(values[:n]):
            for name, p in self._params:  # collective, every rank in the same order
                full = safe_get_full_fp32_param(p)
                if keep:
                    out[name] = full.detach().cpu().reshape(tuple(getattr(p, "ds_shape", p.shape))).clone()
        return out

    def _from_name(self, by_name: dict[str, torch.Tensor], into: list[torch.Tensor]) -> None:
        if self._params is None:
            super()._from_name(by_name, into)
            return
        from deepspeed.utils import safe_set_full_fp32_param

        n = self._n_masters
        for name, t in zip(self._buffer_names, into[n:], strict=True):
            t.copy_(by_name[name].to(t.device, t.dtype).view_as(t))
        with self._in_masters_place(None) as masters:
            for name, p in self._params:
                safe_set_full_fp32_param(p, by_name[name].to(self._ds.device))
            for t, m in zip(into[:n], masters, strict=True):
                t.copy_(m)

    def is_parameter(self, index: int) -> bool:
        return index < self._n_masters  # the masters stand for the parameters; the rest are floating buffers

    def average_parameters(self, tensors: list[torch.Tensor], is_param: Optional[list[bool]] = None) -> bool:
        s = self._ds
        assert s.mpu is not None
        kinds = is_param if is_param is not None else [i < self._n_masters for i in range(len(tensors))]
        masters = [t for t, p in zip(tensors, kinds, strict=True) if p]
        buffers = [t for t, p in zip(tensors, kinds, strict=True) if not p]
        if s.ft is not None:  # fault-tolerant groups: this launch is one group, the average across goes via torchft
            s.average_over(buffers, None, s.world_size)
            return bool(s.ft.average(tensors))
        s.average_over(masters, s.mpu.cross_group, s.mpu.cross_size)
        # the buffers over the group's ranks, then across the groups: Strategy.average_parameters' rule
        s.average_over(buffers, s.mpu.dp_group, s.mpu.size)
        s.average_over(buffers, s.mpu.cross_group, s.mpu.cross_size)
        return True

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return self._ds.all_reduce(tensor, op)

    # the compressed exchange of the masters' pseudo-gradient: over the cross group, as their average
    def averaging_size(self) -> int:
        return self._ds.averaging_size()

    def start_all_to_all(self, rows: torch.Tensor) -> Any:
        return self._ds.start_all_to_all(rows)

    def start_all_gather(self, row: torch.Tensor) -> Any:
        return self._ds.start_all_gather(row)

    def _updated(self) -> None:
        self._refresh()  # the model's weights from the averaged masters: the next step starts from them
