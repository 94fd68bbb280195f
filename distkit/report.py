"""The run's summary (:meth:`distkit.Session.summary`, the keys of ``summary.json``): what every rank measured,
and whether the ranks hold the same model state. The Session's own report code, kept apart from its
API: it reads the session's counters and model and changes nothing."""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn

from distkit.backends.base import Strategy
from distkit.backends.parts import persistent_buffers, whole
from distkit.config import RunConfig
from distkit.env import ClusterEnv
from distkit.evaluation import param_checksum


class SessionView(Protocol):
    """What this module reads (and sets) of :class:`distkit.Session`, which has every member: typed by this
    protocol, the module does not import the Session (it sits below it).
    """

    _kept: list[nn.Module]
    _last_loss: Optional[torch.Tensor]
    _model: Optional[nn.Module]
    _setup_time_s: float
    _strategy: Strategy
    _t_created: float
    _t_start: float
    cfg: RunConfig
    checkpoint_stalls_s: list[float]
    env: ClusterEnv
    num_samples: int
    num_steps: int
    run_id: Optional[str]

    def _collective(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Runs a collective, its timeout line naming ``what``."""

    def _require_setup(self, call: str) -> None:
        """UsageError naming ``call`` before setup."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Collective: every rank must call it, in the same order."""

    @property
    def comm_wait_s(self) -> float:
        """Seconds blocked on training collectives."""

    @property
    def compute_time_s(self) -> float:
        """Seconds spent computing steps."""

    @property
    def fault_tolerance(self) -> Any:
        """torchft's Manager of a fault-tolerant group, else None."""

    def topology(self) -> dict[str, Any]:
        """Hosts, nodes and node ranks."""

    def unwrap(self, model: Optional[nn.Module] = None) -> nn.Module:
        """The plain module inside the engine's wrapper."""

    @property
    def world_size(self) -> int:
        """Ranks in the job."""


def alone_syncs(syncs: list[dict[str, Any]], num_replicas: int) -> dict[str, int]:
    """``alone_syncs``: the committed syncs this group made with no other group (of ``num_replicas`` > 1), and
    ``last_syncs_alone``: how many of the last syncs in a row were so. After one of those, this group's model
    is not the other groups' (they ended, failed or never started): the run's last line says so."""
    if num_replicas <= 1:
        return {"alone_syncs": 0, "last_syncs_alone": 0}
    alone = [x["committed"] and x["groups"] == 1 and not x["healed"] for x in syncs]
    trailing = 0
    for was_alone in reversed(alone):
        if not was_alone:
            break
        trailing += 1
    return {"alone_syncs": sum(alone), "last_syncs_alone": trailing}


def summary(session: SessionView, **extra: Any) -> dict[str, Any]:
    """Collective: see :meth:`distkit.Session.summary`."""
    session._require_setup("summary()")
    s, d = session._strategy, session.cfg.distributed
    wall = time.perf_counter() - session._t_start
    loss = None
    if session._last_loss is not None:
        loss = float(session.all_reduce(session._last_loss.float().reshape(1).cpu().clone(), op="mean"))
    params = list(s.full_named_parameters(session._model))  # type: ignore[arg-type]
    checksum = param_checksum(params)
    # In sync means the whole model state: parameters and persistent buffers (BatchNorm statistics).
    buffers = [(f"buffer.{i}", b) for i, b in enumerate(persistent_buffers(session.unwrap()))]
    # ... and every module registered with keep_in_sync (an EMA copy)
    # (whole: a sharded copy's DTensors gathered, a collective every rank runs in the same order)
    kept = [(f"kept.{i}.{n}", whole(t)) for i, m in enumerate(session._kept) for n, t in m.state_dict().items()
            if torch.is_tensor(t)]
    state = param_checksum(params + buffers + kept) if buffers or kept else checksum
    with session._collective("the checksum exchange of dk.summary()"):
        in_sync = all(c == state for c in s.all_gather_object(state))
    out = {
        "backend": d.backend, "backend_impl": s.backend_impl(), "reduce_type": d.reduce_type,
        "param_sync_step": d.param_sync_step if d.reduce_type == "param" else None,
        "param_sync_group_size": d.param_sync_group_size if d.reduce_type == "param" else None,
        "world_size": session.world_size, **session.topology(), "launcher": session.env.launcher,
        "zero_stage": getattr(s, "zero_stage", None),
        "steps": session.num_steps, "samples": session.num_samples, "final_train_loss": loss,
        "eval_loss": None, "eval_accuracy": None, "best_eval_loss": None, "best_eval_step": None,
        "param_checksum": checksum, "ranks_in_sync": in_sync,
        "wall_time_s": wall, "setup_time_s": session._setup_time_s,
        "checkpoints": len(session.checkpoint_stalls_s), "checkpoint_stall_s": sum(session.checkpoint_stalls_s),
        "checkpoint_stalls_s": [round(t, 6) for t in session.checkpoint_stalls_s],
        "total_time_s": time.perf_counter() - session._t_created, "samples_per_s": session.num_samples / max(wall, 1e-9),
        "compute_fraction": session.compute_time_s / max(wall, 1e-9), "comm_wait_s": session.comm_wait_s,
        "comm_bytes": s.comm_bytes,
        "stopped_early": False, "run_id": session.run_id,
    }
    ft = session.fault_tolerance
    if ft is not None:  # fault-tolerant replica groups: this group, and every change of the groups in the syncs
        out["fault_tolerance"] = {"replica_id": ft.replica_id, "num_replicas": ft.num_replicas, "syncs": len(ft.syncs),
                                  "committed": sum(x["committed"] for x in ft.syncs), "heals": ft.heals,
                                  "manager_step": ft.manager.current_step(),
                                  "membership": ft.membership_changes(), "wait_s": ft.wait_s,
                                  # late = 'merge': syncs that went ahead without a group, late pseudo-gradients merged
                                  "ahead_without": ft.ahead_without, "late_merged": ft.late_merged,
                                  **alone_syncs(ft.syncs, ft.num_replicas)}
    out.update(extra)
    return out



class Reports:
    """Mixin: :meth:`distkit.Session.summary` and the clock it reads (a Session is a :class:`SessionView`)."""

    _t_created: float
    _t_start: float
    _setup_time_s: float

    def _start_clock(self) -> None:
        """Training starts now: ``setup_time_s`` counts up to here and ``wall_time_s`` from here. :meth:`setup` calls
        it; distkit's Trainer again when its loop starts, after the resume and the trackers' start (W&B's takes
        seconds), which are start-up too."""
        self._t_start = time.perf_counter()
        self._setup_time_s = self._t_start - self._t_created

    def summary(self, **extra: Any) -> dict[str, Any]:
        """Collective: the run's summary (the keys of ``summary.json``, which rank 0 writes).

        ``param_checksum``: sha256 of this rank's parameters (fp32, ``named_parameters`` order; rank
        0's in summary.json); ``ranks_in_sync``: every rank holds rank 0's parameters *and* persistent
        buffers (BatchNorm statistics), bit for bit (the same answer on every rank); ``final_train_loss``: the last backward's loss, mean over ranks; ``comm_bytes``:
        payload bytes this rank handed to collectives; ``compute_fraction``: time from the fetch of a
        step's first micro-batch to the end of its step, less ``comm_wait_s``, summed, over wall time
        since setup (this process's clock); ``comm_wait_s``: seconds blocked on the training
        collectives (DDP/DeepSpeed: from the last gradient computed to backward's return; the mpi
        engine's and Horovod's gradient waits; param mode's averaging). ``wall_time_s``: seconds from the end of :meth:`setup` to now (the loop);
        ``setup_time_s``: from :func:`init` to the end of setup (process group, engine, model wrap; under distkit's Trainer
        to the start of its loop: also the resume and the trackers' start);
        ``total_time_s``: from :func:`init` to now. ``extra`` keys are added (the Trainer's eval results).
        """
        return summary(self, **extra)  # type: ignore[arg-type]  (a Session is a SessionView)


# -- the step meter -----------------------------------------------------------------------------------
# What a rank's steps cost, as :meth:`distkit.Session.summary` reports it: training samples, compute time
# and the time blocked on the training collectives (``compute_fraction`` excludes that wait).
#
# A step's compute time runs from the fetch of its first micro-batch (a :meth:`~distkit.Session.dataloader`
# batch that a backward then used; batches of an evaluation loader count for nothing) to the end of its
# optimizer step, less the time blocked on communication: what the engine reports as blocked in that window
# (``Strategy.blocked_s``: the mpi engine's and Horovod's gradient waits, param mode's averaging, the fsdp
# engine's all-gathers in forward and backward and its reduce-scatters) plus,
# on engines that wait for their all-reduce inside backward (DDP, DeepSpeed), the time from the last
# gradient computed to backward's return. All times: this process's ``time.perf_counter``, seconds.
class StepMeter:
    """The counters of one rank. Not collective; the Session calls it around backward and step."""

    def __init__(self, blocked: Callable[[], float] = lambda: 0.0) -> None:
        """``blocked()``: the engine's seconds blocked on training collectives so far (``Strategy.blocked_s``)."""
        self._blocked = blocked
        #: seconds spent computing steps (see the module docstring), and blocked on training collectives
        self.compute_time_s = 0.0
        self.comm_wait_s = 0.0
        self._pending_samples = 0  # local samples of this step's micro-batches (those a backward used)
        #: (samples, fetch start, blocked() at hand-out) of the newest batch
        self._last_batch: Optional[tuple[int, float, float]] = None
        self._blocked_start: Optional[float] = None  # blocked() when this step's first micro-batch was handed out
        self._t_batch: Optional[float] = None  # when fetching this step's first micro-batch began
        self._step_wait_s = 0.0  # of the step in progress
        self._t_grad_ready: Optional[float] = None  # when the newest gradient was accumulated

    def batch_handed_out(self, n: int, t_fetch: float) -> None:
        """A loader handed out a batch of ``n`` local samples whose fetch began at ``t_fetch``. Counted only
        when a backward uses it."""
        self._last_batch = (n, t_fetch, self._blocked())

    def gradient_ready(self, _param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated (a post-accumulate-grad hook)."""
        self._t_grad_ready = time.perf_counter()

    def backward_begins(self) -> None:
        """A backward pass uses the newest batch handed out: its samples count for this step."""
        n, t_fetch, blocked = (self._last_batch if self._last_batch is not None else
                               (0, time.perf_counter(), self._blocked()))
        self._last_batch = None
        self._pending_samples += n
        if self._t_batch is None:
            self._t_batch, self._blocked_start = t_fetch, blocked
        self._t_grad_ready = None

    def backward_ended(self) -> None:
        """Backward returned."""
        if self._t_grad_ready is not None:
            # The engine waited for its all-reduce inside backward: from the last gradient computed to
            # the return is waiting on communication (DDP's reducer finalising its buckets).
            self._step_wait_s += max(0.0, time.perf_counter() - self._t_grad_ready)

    def step_ended(self, engine_wait_s: float) -> int:
        """The optimizer step ended, after ``engine_wait_s`` seconds blocked inside it; returns this step's
        local training samples. The step's wait is what the engine reported as blocked since its first
        micro-batch was handed out (forward, backward and step: FSDP2 gathers parameters in forward), or
        ``engine_wait_s`` where no backward began this step."""
        samples, self._pending_samples = self._pending_samples, 0
        if self._blocked_start is not None:
            self._step_wait_s += self._blocked() - self._blocked_start
            self._blocked_start = None
        else:
            self._step_wait_s += engine_wait_s
        if self._t_batch is not None:
            self.compute_time_s += time.perf_counter() - self._t_batch - self._step_wait_s
            self._t_batch = None
        self.comm_wait_s += self._step_wait_s
        self._step_wait_s = 0.0
        return samples
