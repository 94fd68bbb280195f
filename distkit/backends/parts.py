"""What the engines share besides the :class:`~distkit.backends.base.Strategy` interface: DDP's rules for unused
parameters and buffers, the failure report, the bare module inside wrappers, and param mode's averager."""
from __future__ import annotations

import sys
import traceback
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
from torch import nn

from distkit.config import RunConfig
from distkit.errors import DistkitError, UnusedParameters, UsageError
from distkit.sync.averager import ParamAverager, Reducer
from distkit.sync.compression import codec_of


class EngineView(Reducer, Protocol):
    """What these shared parts use of an engine (:class:`~distkit.backends.base.Strategy` has it): the sync
    code's collectives (:class:`~distkit.sync.averager.Reducer`), the topology and the config. Typed by it, the
    parts never import the Strategy, which imports them."""

    rank: int
    world_size: int
    cfg: RunConfig


#: the fix for a parameter without gradient where the engine follows DDP's rule (mpi, Horovod)
FIND_UNUSED_FIX = ("as under DDP, set distributed.options = {'find_unused_parameters': True} (--find_unused_parameters) "
                   "for parameters a step may leave unused, or freeze them (requires_grad_(False))")


#: the fix where the ranks run different modules in one step (fsdp, ZeRO: they cannot give DDP's result there)
SOME_RANKS_FIX = ("run each module on every rank (a branch not taken can add 0 * its output), or use backend 'ddp' "
                  "with distributed.options = {'find_unused_parameters': True}")


def shown_names(names: list[str]) -> str:
    """The first three of ``names``, quoted, with " ..." after them where there are more (for a one-line error)."""
    return ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")


def unused_parameters(rank: int, names: list[str], fix: str = FIND_UNUSED_FIX) -> UnusedParameters:
    """The error for trainable parameters ``names`` that got no gradient in this step on ``rank``."""
    return UnusedParameters(f"rank {rank}: {len(names)} parameter(s) got no gradient in this step "
                            f"({shown_names(names)}): {fix}")


def drop_globally_unused(strategy: EngineView, params: list[torch.Tensor], seen: set[int],
                         had_grad: dict[int, bool],
                         all_reduce: Optional[Callable[[torch.Tensor, str], Any]] = None) -> None:
    """Collective: DDP's rule with ``find_unused_parameters``: a parameter that no rank used (its id in no
    rank's ``seen``) keeps no gradient, so the optimizer skips it (no weight decay, no momentum), unless an
    earlier reduction of this step gave it one (``had_grad``). One small MAX all-reduce of a used-mask, over
    the ranks that reduce gradients together: ``all_reduce(tensor, op)`` (default ``strategy.all_reduce``,
    every rank; a replica group's own reduction with replica groups, as DDP on a process group)."""
    used = torch.tensor([1.0 if id(p) in seen else 0.0 for p in params])
    (all_reduce or strategy.all_reduce)(used, "max")
    for p, u in zip(params, used.tolist(), strict=True):
        if not u and not had_grad.get(id(p), False):
            p.grad = None


def graph_parameters(loss: torch.Tensor) -> set[int]:
    """The ids of the leaf tensors ``loss``'s autograd graph accumulates gradients into (what DDP's
    ``find_unused_parameters`` traverses): the parameters this rank's backward will give a gradient."""
    used: set[int] = set()
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # AccumulateGrad's leaf
        if var is not None:
            used.add(id(var))
        stack.extend(f for f, _ in fn.next_functions)
    return used


def same_parameters_on_every_rank(strategy: EngineView, loss: torch.Tensor, trainable: list[tuple[str, Any]],
                                  engine: str) -> None:
    """Collective (one byte per parameter, gathered from every rank): before a backward whose reductions follow
    the parameters that get gradients (DeepSpeed's buckets), UsageError on every rank when some ranks' graphs use
    a parameter that others' do not (a module some ranks run: a branch on the data, layer drop), which such an
    engine reduces mismatched; naming the parameters, the ranks that use them, and the fix."""
    import torch.distributed as dist

    used = graph_parameters(loss)
    mine = torch.tensor([1 if id(p) in used else 0 for _, p in trainable], dtype=torch.uint8)
    every = torch.empty(strategy.world_size * len(trainable), dtype=torch.uint8)
    dist.all_gather_into_tensor(every, mine)
    rows = every.view(strategy.world_size, len(trainable))
    differ = (rows.min(dim=0).values != rows.max(dim=0).values).nonzero().flatten().tolist()
    if differ:
        shown = shown_names([trainable[i][0] for i in differ])
        users = [r for r in range(strategy.world_size) if rows[r, differ[0]]]
        raise UsageError(f"rank {strategy.rank}: the ranks run different modules in this step ({shown} used by "
                         f"rank(s) {', '.join(map(str, users))} only): {engine} reduces the gradients of the "
                         f"parameters every rank used; {SOME_RANKS_FIX}")


def report_failure(rank: int, world_size: int, engine: str) -> int:
    """Print which rank failed and why (traceback for bugs, one line for DistkitErrors).

    Called from a Strategy's ``abort`` inside an ``except`` block; returns the exit status
    to abort the job with (the error's own for DistkitError, else 1).
    """
    from distkit.health.lost import lost_peer_error

    # sys.__stderr__: torch.distributed's excepthook (installed when a process group starts after distkit's hook,
    # e.g. by Lightning's or Accelerate's DDP in the same ranks) calls distkit's with sys.stderr swapped for a buffer
    # that it prints afterwards; the abort below ends the process first, and the buffer with it
    err = sys.__stderr__ or sys.stderr
    exc = sys.exc_info()[1]
    if exc is not None and not isinstance(exc, DistkitError):
        traceback.print_exc(file=err)
        exc = lost_peer_error(exc) or exc  # a peer is gone: name it
    what = f"{type(exc).__name__}: {exc}" if exc is not None else "aborted"
    print(f"distkit: rank {rank} failed: {what} (aborting all {world_size} {engine} ranks)", file=err, flush=True)
    sys.stdout.flush()
    return exc.exit_code if isinstance(exc, DistkitError) else 1


def bare_module(module: nn.Module) -> nn.Module:
    """``module`` without ``torch.compile``'s wrapper (``OptimizedModule._orig_mod``): checkpoints, checksums
    and averaging then use the model's own names (``fc.weight``, not ``_orig_mod.fc.weight``), so a
    checkpoint of a compiled run loads into an uncompiled model and back. Training runs the compiled one."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else module


def persistent_buffers(module: nn.Module) -> list[torch.Tensor]:
    """Buffers that are part of the model's state (``state_dict``): BatchNorm statistics, counters.
    Non-persistent buffers (``register_buffer(..., persistent=False)``: causal masks, rotary caches)
    are derived constants; rank 0's copy is broadcast once at setup and never again."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for mod in module.modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                out.append(b)
    return out


def whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor (a DTensor: fsdp's parameters) gathered whole, a collective over its mesh that every rank
    of it runs in the same order; any other tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (a DTensor: a view, writing it writes the parameter; no
    communication), any other tensor as it is: :func:`whole`'s local counterpart."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def float_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s floating-point parameters and buffers by name (each tensor once): what parameter
    averaging averages of a module registered with ``dk.keep_in_sync``."""
    return [(n, t) for n, t in parameters_and_float_buffers(module) if t.is_floating_point()]


def parameters_and_float_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What parameter averaging averages, with the model's names: every parameter and every
    floating-point buffer (each tensor once: tied parameters under their first name)."""
    yield from module.named_parameters()
    for n, b in module.named_buffers():
        if b.is_floating_point():
            yield n, b


def param_averager(strategy: EngineView, module: nn.Module) -> ParamAverager:
    """The :class:`~distkit.sync.averager.ParamAverager` of ``module``'s parameters and floating buffers,
    configured from ``strategy.cfg.distributed`` (param mode on the ddp, mpi and Horovod engines)."""
    named = list(parameters_and_float_buffers(bare_module(module)))
    d = strategy.cfg.distributed
    return ParamAverager(strategy, [t for _, t in named], d.param_sync_step, d.param_sync_time_diff,
                         d.outer_optimizer, names=[n for n, _ in named], fragments=d.param_sync_fragments,
                         compression=codec_of(d), error_feedback=d.param_sync_error_feedback,
                         overlap=d.param_sync_overlap)
