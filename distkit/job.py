"""This rank's place in the job: the engine it joined, the job's topology and the collectives a script may
call. :class:`distkit.Session` is a Job that also trains a model (setup, backward, step, checkpoints);
the Job part knows nothing of models, so it holds what is true of every rank from start-up on."""
from __future__ import annotations

import contextlib
import functools
import socket
from typing import Any, Iterator, Optional

import torch
from torch.utils import _pytree as pytree

from distkit.health import faults
from distkit.backends import startup, strategy_class
from distkit.backends.base import Strategy
from distkit.components import pick_device
from distkit.config import RunConfig
from distkit.env import ClusterEnv
from distkit.errors import CollectiveTimeout, UsageError
from distkit.launch.netif import host_identity
from distkit.health.watchdog import STOP_JOIN_S, start_watchdog


class Job:
    """The engine this rank joined (collective to make: every rank at once), who is where, and the
    collectives. Made through :class:`distkit.Session` (``distkit.init``)."""

    def __init__(self, cfg: RunConfig, env: ClusterEnv) -> None:
        self.cfg, self.env = cfg, env
        device = pick_device(cfg.device, env.local_rank, env.local_world_size)
        self._strategy: Strategy = strategy_class(cfg.distributed.backend)(cfg, env, device)
        startup.begin()  # every wait is start-up's until the ranks meet after the first step (_end_startup)
        self._strategy.init()
        d = cfg.distributed
        self._watchdog = start_watchdog(self._strategy, d.timeout_s, d.startup_s())  # names a stalled rank
        if self._watchdog is not None:  # where an engine's own start-up waits are bounded by timeout_s (Horovod)
            self._strategy.meet = functools.partial(self._watchdog.meet, timeout_s=d.startup_s())
        # every rank's (host name, host identity), in rank order: one object all-gather at start-up; the
        # identity tells apart hosts that share a name (containers, network namespaces)
        me = (socket.gethostname(), host_identity())
        self._rank_hosts: list[tuple[str, str]] = (self._strategy.all_gather_object(me) if env.is_distributed
                                                   else [me])

    # -- topology -----------------------------------------------------------------------
    @property
    def hosts(self) -> list[str]:
        """The job's hosts' names, one per host in the order of their lowest rank (node rank order);
        hosts that share a name appear once each."""
        return [name for name, _ in dict.fromkeys(self._rank_hosts)]

    @property
    def node_ranks(self) -> list[int]:
        """Each rank's node rank (index into :attr:`hosts`), in rank order."""
        nodes = list(dict.fromkeys(self._rank_hosts))
        return [nodes.index(h) for h in self._rank_hosts]

    def topology(self) -> dict[str, Any]:
        """``hosts``, ``num_nodes`` and ``node_ranks`` (per rank), as summary.json and
        config.resolved.json record them (from the host names the ranks reported, not the launcher's)."""
        return {"hosts": self.hosts, "num_nodes": len(self.hosts), "node_ranks": self.node_ranks}

    @property
    def rank(self) -> int:
        return self._strategy.rank

    @property
    def world_size(self) -> int:
        return self._strategy.world_size

    @property
    def local_rank(self) -> int:
        return self._strategy.local_rank

    @property
    def device(self) -> torch.device:
        return self._strategy.device

    @property
    def is_main(self) -> bool:
        return self._strategy.is_main

    @property
    def backend(self) -> str:
        """The engine's name: ddp, deepspeed, horovod or mpi."""
        return self._strategy.name

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only (always flushed; a ``flush`` argument is accepted and ignored)."""
        kwargs.pop("flush", None)
        if self.is_main:
            print(*args, **kwargs, flush=True)

    # -- the end of start-up (Session.step) ----------------------------------------------------------
    def _end_startup(self) -> None:
        """Collective, once (every rank after its first optimizer step): the ranks meet (through the heartbeat
        store, bounded by ``distributed.startup_s()``; an engine barrier without a watchdog), and from then on every
        collective and the watchdog's judge are bounded by ``timeout_s``. Until then start-up's bound holds
        everywhere (:mod:`distkit.backends.startup`): the ranks drift apart by seconds in set-up on a loaded
        machine (rank 0 alone picks the checkpoint and writes the run's first files), and in param mode that
        drift lasts until the first sync, many steps on, unless they meet here."""
        if self._watchdog is not None:
            self._watchdog.meet("the end of start-up (the first optimizer step)", self.cfg.distributed.startup_s())
        elif self.world_size > 1:
            self._strategy.barrier()
        startup.end()
        self._strategy.end_startup()
        if self._watchdog is not None:
            self._watchdog.end_startup()

    # -- the end of the job (Session.close) ----------------------------------------------------------
    def _meet_at_end(self) -> bool:
        """Collective after a normal run: the ranks leave together (a barrier, bounded by ``timeout_s``), since a
        rank that tears gloo down while a peer still finishes the last exchange has been seen to end that peer
        with "terminate called" (SIGABRT). Returns whether they met (False on one rank)."""
        if self.world_size == 1:
            return False
        try:
            self._strategy.before_last_meet()
            self._strategy.barrier()
        except Exception:  # noqa: BLE001 - a peer is gone: leave alone
            return False
        faults.maybe_fire(self.rank, getattr(self, "num_steps", 0), "close")
        return True

    def _leave(self, together: bool) -> None:
        """Stop the watchdog, tear the engine down and, after a run whose ranks met at the end, wait for this
        host's other ranks to leave (:meth:`distkit.health.watchdog.Watchdog.see_local_peers_out`)."""
        if self._watchdog is not None:
            # the ranks met just now, so the store (rank 0's) answers: wait for the beater's call in flight, however
            # slow the machine (2 s was passed under load, and the rank then aborted at exit: see Watchdog.stop)
            self._watchdog.stop(min(float(self.cfg.distributed.timeout_s), 30.0) if together else STOP_JOIN_S)
        self._strategy.teardown()
        if together and self._watchdog is not None:
            # (distkit's spawner ends a rank stopped on its way out itself, naming it: no exit watcher there)
            self._watchdog.see_local_peers_out(float(self.cfg.distributed.timeout_s),
                                               watch_exit=self.env.launcher != "spawn")
            self._watchdog.release()  # (this host's ranks have left; the others met here and stopped beating)
        faults.maybe_fire(self.rank, getattr(self, "num_steps", 0), "left")

    # -- collectives ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """Name the collective in a timeout (gloo reports only "timed out"; the mpi engine's own timeout line
        names it too, through ``Strategy.doing``)."""
        before, self._strategy.doing = self._strategy.doing, what
        try:
            yield
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise CollectiveTimeout(
                    f"{what} timed out after {startup.bound_text(self.cfg.distributed)}: a rank "
                    "did not call it (every rank must call collectives in the same order) or hung or died") from e
            raise
        finally:
            self._strategy.doing = before

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Collective: ``tensor`` reduced over ranks in place (and returned); op is mean|sum|max|min."""
        if op not in ("mean", "sum", "max", "min"):
            raise UsageError(f"dk.all_reduce: op must be mean, sum, max or min, got {op!r}")
        with self._collective(f"dk.all_reduce(op={op!r})"):
            return self._strategy.all_reduce(tensor, op=op)

    def barrier(self) -> None:
        """Collective: returns when every rank has called it."""
        with self._collective("dk.barrier()"):
            self._strategy.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Collective: ``src``'s picklable ``obj`` on every rank."""
        with self._collective("dk.broadcast_object()"):
            return self._strategy.broadcast_object(obj, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Collective: every rank's picklable ``obj``, in rank order."""
        with self._collective("dk.all_gather_object()"):
            return self._strategy.all_gather_object(obj)


# -- dk.gather ----------------------------------------------------------------------------------------
# ``dk.gather``: every rank's tensors, concatenated in rank order, on every rank (Accelerate's ``gather_for_metrics``).
#
# Built on :meth:`Strategy.all_reduce`, which every engine has: each rank writes its rows into its own slot of a
# zero buffer and the sum is the concatenation (a sum with zeros is exact, so the values are the ranks' bit for bit).
# Costs ``world_size`` times the data of an all-gather; it is meant for evaluation outputs and metrics, once per
# batch, not for the training step.
#: dtypes an all-reduce sums as they are; others (bool, 16-bit floats) travel as one of these and come back exact
_EXACT = {torch.float32, torch.float64, torch.int32, torch.int64}


def gather(job: Job, data: Any, keep: Optional[int] = None) -> Any:
    """Collective: ``data`` (a tensor, or tuples, lists and dicts of them) from every rank, each tensor concatenated
    along dim 0 in rank order; ``keep``: keep only the first ``keep`` rows of each (the real samples of a padded last
    batch). Ranks may hold different numbers of rows; the other dimensions and the dtype must agree."""
    leaves, spec = pytree.tree_flatten(data)
    bad = [type(t).__name__ for t in leaves if not isinstance(t, torch.Tensor)]
    if bad:
        raise UsageError(f"dk.gather(data): needs tensors (or tuples, lists, dicts of them), got {bad[0]}: convert "
                         "numbers with torch.tensor(...), or use dk.all_gather_object for other objects")
    shapes = [tuple(t.shape) if t.dim() else (1,) for t in leaves]
    everyone = job.all_gather_object([(s, str(t.dtype)) for s, t in zip(shapes, leaves)])
    out = []
    for i, t in enumerate(leaves):
        theirs = [e[i] for e in everyone]
        if len({(s[1:], d) for s, d in theirs}) > 1:
            raise UsageError(f"dk.gather: tensor {i} differs across ranks beyond its first dimension: "
                             f"{[f'{list(s)} {d}' for s, d in theirs]}; gather tensors of one shape and dtype")
        rows = [s[0] for s, _ in theirs]
        flat = t.reshape(shapes[i])
        wire = flat if flat.dtype in _EXACT else flat.to(torch.float64 if flat.is_floating_point() else torch.int64)
        buf = torch.zeros((sum(rows), *shapes[i][1:]), dtype=wire.dtype, device=t.device)
        lo = sum(rows[:job.rank])
        buf[lo:lo + rows[job.rank]] = wire
        buf = job.all_reduce(buf, op="sum").to(t.dtype)
        out.append(buf[:keep] if keep is not None else buf)
    return pytree.tree_unflatten(out, spec)
