"""The Horovod engine's collectives (:class:`~distkit.backends.horovod.HorovodEngine` inherits them): the loop's
all-reduce, broadcasts and object exchange through ``horovod.torch``, every op in flight under its own name."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional

import torch

from . import startup


class _Handle:
    """A Horovod op started with its ``*_async`` function: ``wait()`` returns its output."""

    def __init__(self, hvd: Any, handle: Any, bounded: Optional[Callable[[str], ContextManager[None]]] = None) -> None:
        self.hvd, self.handle, self.bounded = hvd, handle, bounded

    def wait(self) -> torch.Tensor:
        with self.bounded("Horovod's background op") if self.bounded is not None else contextlib.nullcontext():
            out = self.hvd.synchronize(self.handle)
        return out[0] if isinstance(out, tuple) else out  # alltoall's received splits are not needed


class HorovodCollectives:
    """Collectives over every rank through ``self.hvd`` (``horovod.torch``, set by the engine's ``init``)."""

    hvd: Any
    world_size: int
    comm_bytes: int
    meet: Optional[Callable[[str], None]]  # (Strategy's)
    _named: int  # the background ops started so far (their names)
    _guard: Any = None  # a WaitGuard where the engine bounds its waits itself (HorovodEngine.init, Gloo controller)

    def _gate(self, what: str) -> None:
        """Collective during start-up (every Horovod op of this engine calls it first, on every rank in the same
        order): the ranks meet through the heartbeat store, bounded by start-up's bound (Strategy.meet). Horovod's
        stall inspector shuts Horovod down when some ranks submitted an op and others did not for
        HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (timeout_s: read once, at hvd.init), and in set-up ranks drift apart
        by seconds on a loaded machine (rank 0 alone picks the checkpoint, writes the first files); met first,
        they submit together. Nothing after start-up (:mod:`distkit.backends.startup`) or without a watchdog."""
        if self.meet is not None and self.world_size > 1 and not startup.ended():
            self.meet(f"Horovod's {what} in start-up")

    def _bounded(self, what: str) -> ContextManager[None]:
        """A blocking Horovod wait, bounded where the engine set a guard (``_guard``: under the Gloo controller,
        which runs no stall check; :mod:`distkit.backends.wait_guard`)."""
        guard = self._guard
        return guard.waiting(what) if guard is not None else contextlib.nullcontext()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Collective: every rank must call it, in the same order. In place; op is sum|mean|max|min."""
        if self.world_size == 1:
            return tensor
        self._gate("allreduce")
        hvd = self.hvd
        self.comm_bytes += tensor.numel() * tensor.element_size()
        # mean = sum, then divide (as the other engines do: the same rounding everywhere)
        with self._bounded("Horovod's allreduce"):
            out = hvd.allreduce(tensor.detach(), op=self._op(op))
        if op == "mean":
            out = out / self.world_size
        with torch.no_grad():
            tensor.copy_(out)
        return tensor

    def _op(self, op: str) -> Any:
        """Horovod's reduction for ``op`` (mean: a sum, divided by the caller)."""
        hvd = self.hvd
        return {"sum": hvd.Sum, "mean": hvd.Sum, "max": hvd.Max, "min": hvd.Min}[op]

    def start_all_reduce(self, tensor: torch.Tensor, op: str = "max") -> Any:
        if self.world_size == 1:
            return super().start_all_reduce(tensor, op)  # type: ignore[misc]  # (Strategy's, next in the MRO)
        self._gate("allreduce")
        hvd = self.hvd
        self.comm_bytes += tensor.numel() * tensor.element_size()
        return _Handle(hvd, hvd.allreduce_async(tensor.detach(), op=self._op(op), name=self._next_name("all_reduce")),
                       self._bounded)

    def _next_name(self, kind: str) -> str:
        """The name of the next op started in the background: Horovod's ranks match ops by name, so every op in
        flight needs its own; every rank starts the same ops in the same order, so the count agrees."""
        self._named += 1
        return f"distkit.{kind}.{self._named}"

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Collective: every rank must call it, in the same order. Returns ``src``'s object."""
        # An explicit name: Horovod's default is the object's type name, and ranks that pass objects of
        # different types (None on the receivers) would each wait for a different tensor (a deadlock).
        if self.world_size == 1:
            return obj
        self._gate("broadcast_object")
        with self._bounded("Horovod's broadcast_object"):
            return self.hvd.broadcast_object(obj, root_rank=src, name="distkit.broadcast_object")

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Collective: every rank must call it, in the same order. Returns one object per rank."""
        if self.world_size == 1:
            return [obj]
        self._gate("allgather_object")
        with self._bounded("Horovod's allgather_object"):
            return list(self.hvd.allgather_object(obj, name="distkit.all_gather_object"))

    def barrier(self) -> None:
        """Collective: every rank must call it, in the same order."""
        if self.world_size > 1:
            self._gate("barrier")
            with self._bounded("Horovod's barrier"):
                self.hvd.barrier()

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Collective: every rank must call it, in the same order. In-place ``hvd.broadcast_`` of each tensor."""
        if self.world_size == 1:
            return
        self._broadcast(tensors, src, self.hvd.global_process_set)

    def _broadcast(self, tensors: list[torch.Tensor], root_rank: int, process_set: Any) -> None:
        """Collective over ``process_set``: in-place ``hvd.broadcast_`` of each tensor from global rank ``root_rank``
        (a member of the set), all started before the first is waited for."""
        self._gate("broadcast")
        handles = []
        for t in tensors:
            self.comm_bytes += t.numel() * t.element_size()
            handles.append(self.hvd.broadcast_async_(t.detach(), root_rank=root_rank, process_set=process_set))
        with self._bounded("Horovod's broadcast"):
            for h in handles:
                self.hvd.synchronize(h)
