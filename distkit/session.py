"""The public library API: ``distkit.init()`` and the :class:`Session` it returns.

One object holds the engine (a Strategy, internal), the wrapped model/optimizer/scheduler
and the loop state; a user's own training loop and ``distkit train`` (the Trainer is
built on this class) take the same path. The engine and the mode come from configuration
only, so the same script runs on ddp, deepspeed, horovod and mpi, in grad and param mode::

    import argparse, distkit
    parser = argparse.ArgumentParser()
    distkit.add_arguments(parser)
    dk = distkit.init(parser.parse_args())
    model, optimizer = dk.setup(model, optimizer)
    loader = dk.dataloader(dataset, batch_size=16)
    for epoch in range(3):
        loader.set_epoch(epoch)
        for x, y in loader:
            dk.backward(loss_fn(model(x), y))
            dk.step()
    dk.finish()
    dk.save("ckpt", {"model": model, "optimizer": optimizer, "epoch": epoch})

Cross-rank contract: methods documented as "Collective" must be called by every rank, in
the same order (``setup``, ``dataloader``, ``step``, ``finish``, ``save``, ``load``,
``summary``, ``all_reduce``, ``barrier``); ``backward`` is collective on engines that
reduce during backward (grad mode). A collective some rank never joins fails after
``distributed.timeout_s`` seconds with :class:`~distkit.errors.CollectiveTimeout` naming it.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import random
import sys
import time
import warnings
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch import nn

from distkit.launch import lazy_import

from distkit.launch import ompi_leftovers
from distkit.backends import check_backend, startup, strategy_class
from distkit.backends.parts import float_state, persistent_buffers
from distkit.checkpoint.api import Checkpoints
from distkit.components import ScaledOptimizer, check_device, check_stepped_scheduler, scheduler_and_interval
from distkit.config import RunConfig
from distkit.config.arguments import (  # noqa: F401 (distkit.session's names before the move)
    CONFIGS_DEST, OVERRIDES_DEST, Source, add_arguments, config_from,
)
from distkit.data import ShardedLoader, sharded_loader
from distkit.env import ClusterEnv, check_launched, detect
from distkit.errors import ConfigError, UsageError
from distkit.ft.groups import join as join_groups
from distkit.health import faults
from distkit.health.guards import (
    LossWatch, check_backward, check_step, guard_raw_clip, check_scheduler_steps, install_excepthook, name_missing_module,
    setup_optimizer,
)
from distkit.job import Job, gather
from distkit.launch.spawner import record_stall
from distkit.main_process import set_current_strategy
from distkit.report import Reports, StepMeter
from distkit.health.lost import lost_peer_error
from distkit.health.watchdog import explain_stall


def init(source: Source = None, env: Optional[ClusterEnv] = None, **keys: Any) -> "Session":
    """Join the job and return the :class:`Session` (collective: every rank calls it once).

    ``source``: an ``argparse.Namespace`` from a parser given to :func:`add_arguments`, a config
    dict, a config file path (or a list of them), or a RunConfig; ``keys`` override it
    (``distkit.init("cfg.py", batch_size=16)``). Under plain ``python`` with ``nprocs > 1``
    (``--nprocs N``), this process does not return: it starts the script again as N ranks
    (under ``mpirun`` for the mpi and horovod engines), waits and exits with their status.

    Seeds torch, random and numpy with ``seed`` (the same on every rank), so a model built
    after ``init`` starts identical everywhere (``setup`` broadcasts rank 0's anyway).
    Bad configuration raises :class:`~distkit.errors.ConfigError`; uncaught, any DistkitError
    prints one line ``distkit: error: ...`` and exits with its status (2 for bad input).
    """
    install_excepthook(lambda: Session.current)
    cfg, local_rank = config_from(source, **keys)
    check_backend(cfg)
    check_device(cfg)  # e.g. nccl without CUDA: one line now, not a traceback per rank later
    faults.check()  # a DISTKIT_FAULT that is no fault spec: one line, not a traceback at import
    # (the old torch.distributed.launch passes --local_rank only as an argument)
    environ = dict(os.environ) if local_rank is None else {"LOCAL_RANK": str(local_rank), **os.environ}
    env = env or check_launched(detect(environ), environ)  # a leftover RANK/WORLD_SIZE: one line, not a wait
    if env.launcher == "openmpi" and env.local_rank == 0:  # so a killed mpirun's pid can serve the next one
        ompi_leftovers.clear()
    if env.launcher == "single" and cfg.nprocs > 1:
        from distkit.launch.spawner import relaunch_command, run_local, script_target

        # The ranks resolve their config again from the same command line; they check that they chose this engine.
        os.environ[LAUNCH_ENGINE_VAR] = cfg.distributed.backend
        engine = strategy_class(cfg.distributed.backend)
        # each rank a fork that runs the script again, where that is safe (launch.script_target), else a new one
        code = run_local(relaunch_command(), cfg.nprocs, engine.local_launcher, target=script_target(),
                         preimport=engine.before_forks(cfg) if engine.local_launcher == "spawn" else ())
        sys.stdout.flush()
        sys.exit(code)
    chosen = os.environ.get(LAUNCH_ENGINE_VAR)
    if chosen and env.launcher != "single" and chosen != cfg.distributed.backend:
        raise ConfigError(f"this rank resolved engine '{cfg.distributed.backend}' but the process that started it "
                          f"(--nprocs) chose '{chosen}': the script changed its arguments or config between the two "
                          "(e.g. removed distkit's flags from sys.argv); parse them the same way on every start, or "
                          "launch with torchrun/mpirun yourself")
    return Session(cfg, env)


#: set by the ``--nprocs`` relaunch for its ranks: the engine the launching process resolved
LAUNCH_ENGINE_VAR = "DISTKIT_LAUNCH_ENGINE"


class Session(Job, Checkpoints, Reports):
    """This rank's view of the job: topology, the wrapped model/optimizer, the loop's counters.

    Made by :func:`distkit.init`. Read-only topology (from :class:`~distkit.job.Job`): ``rank``,
    ``world_size``, ``local_rank``, ``device``, ``is_main``, ``hosts``; and the collectives. ``num_steps`` (optimizer steps taken) and ``num_samples`` (global
    training samples, all ranks) count what :meth:`step` saw and are restored by :meth:`load`.
    """

    #: the session of this process, if any (used by run_on_main and the exception hook)
    current: Optional["Session"] = None

    def __init__(self, cfg: RunConfig, env: ClusterEnv) -> None:
        lazy_import.defer_dynamo()  # before the engine's start: nothing of it may import dynamo for real meanwhile
        super().__init__(cfg, env)
        Session.current = self
        set_current_strategy(self._strategy)
        atexit.register(self.close)
        if self.is_main:
            for note in cfg.notes:
                print(f"distkit: {note}", flush=True)
        self._model: Optional[nn.Module] = None
        self._optimizer: Any = None
        self._scheduler: Any = None
        self._scheduler_interval = "step"  # dk.setup's interval
        #: the stepped scheduler's last_epoch as distkit left it (setup, each step, load): check_scheduler_steps
        self._scheduler_mark: Any = None
        self._gather_keep: Optional[int] = None  # real samples of the newest batch when it is a padded last one
        self._failed = self._closed = False
        self.num_steps, self.num_samples = 0, 0
        #: training samples per step of the run a checkpoint from another layout was written by (set by load)
        self.resumed_global_batch: Optional[int] = None
        #: the run this session's checkpoints belong to (``distkit train`` sets it: recorded in each manifest,
        #: ``config.resolved.json`` and ``summary.json``); None in the own-loop API unless the script sets it
        self.run_id: Optional[str] = None
        # samples, compute time, time blocked on the training collectives
        self._meter = StepMeter(lambda: self._strategy.blocked_s)
        self._t_created = self._t_start = time.perf_counter()
        self._setup_time_s = 0.0  # init to the end of setup (summary's setup_time_s)
        #: per checkpoint, in order: seconds this process was blocked in save (or save_async + commit)
        self.checkpoint_stalls_s: list[float] = []
        self._unscaled = False  # 16-mixed: this step's gradients were already unscaled (by clip_grad_norm)
        self._last_loss: Optional[torch.Tensor] = None
        self._loss_watch = LossWatch()  # NaN/inf losses (on CUDA recorded on the device: no synchronisation)
        self._micro = 0  # backward passes since the last step
        self._kept: list[nn.Module] = []  # keep_in_sync
        self._ft: Any = None  # fault_tolerance: this rank's torchft Manager and its syncs
        self._given_optimizer: Any = None  # the optimizer the user passed to setup (the engine may return another)
        self._clip_restore: Optional[Callable[[], None]] = None
        # seeded once close() (registered above, also run at exit) finds every attribute it uses
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        # fp16 autocast needs loss scaling; bf16 does not; DeepSpeed does its own (its bf16/fp16 blocks)
        self._scaler: Optional[torch.amp.GradScaler] = None
        if cfg.precision == "16-mixed" and not self._strategy.handles_precision:
            self._scaler = torch.amp.GradScaler(self.device.type)

    @property
    def compute_time_s(self) -> float:
        """Seconds this rank spent computing training steps, less the waits below (:class:`distkit.report.StepMeter`)."""
        return self._meter.compute_time_s

    @property
    def comm_wait_s(self) -> float:
        """Seconds this rank was blocked on the training collectives (gradient all-reduce, averaging)."""
        return self._meter.comm_wait_s

    @property
    def forward_is_collective(self) -> bool:
        """True where a forward pass communicates (ZeRO-3 gathers parameters in it): an evaluation
        loop must then run the same number of forward passes on every rank."""
        return self._model is not None and self._strategy.forward_is_collective(self._model)

    # -- setup ----------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: Any = None, lr_scheduler: Any = None, interval: str = "step") -> Any:
        """Collective: rank 0's initial state everywhere, model and optimizer wrapped for the engine and mode.

        ``optimizer``: a torch optimizer over ``model``'s parameters, a factory ``params -> Optimizer``
        (called only when the engine's config does not define one), or None where the DeepSpeed config
        has an ``optimizer`` block. ``lr_scheduler`` (optional): a scheduler over that optimizer, or a factory
        ``optimizer -> scheduler`` (called with the engine's optimizer; DeepSpeed calls it itself), stepped
        once per :meth:`step` (``interval="step"``, the default) or never by distkit (``interval="epoch"``: a
        per-epoch scheduler such as pytorch/examples imagenet's ``StepLR(step_size=30)``, which the script steps at
        the end of each epoch as before; Lightning's ``{"scheduler": s, "interval": "epoch"}`` also works). A
        per-epoch scheduler given without ``interval="epoch"`` would decay every ``step_size`` *iterations*.
        Returns ``(model, optimizer)``, or ``(model, optimizer, lr_scheduler)`` when one was given;
        use the returned objects from here on. One model per session.
        """
        lr_scheduler, interval = scheduler_and_interval(lr_scheduler, interval)
        optimizer = setup_optimizer(self._model is not None, model, optimizer, self._strategy.engine_defines_optimizer())
        given = optimizer
        self._given_optimizer = given
        self._scheduler_interval = interval
        # a per-epoch scheduler is the script's to step: not handed to an engine that steps it itself (DeepSpeed)
        self._model, self._optimizer = self._strategy.setup(model, optimizer, lr_scheduler if interval == "step" else None)
        if not hasattr(self._model, "module"):
            name_missing_module(self._model)
        if not self._strategy.grads_in_params:
            self._clip_restore = guard_raw_clip(self)
        if self._strategy.reduces_in_backward:  # DDP/DeepSpeed wait for the all-reduce inside backward
            for p in self.unwrap().parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._meter.gradient_ready)
        self._scheduler = getattr(self._strategy, "lr_scheduler", None) if interval == "step" else None
        if self._scheduler is None and callable(lr_scheduler):  # a factory: over the optimizer the engine returned
            self._scheduler = lr_scheduler(self._optimizer)
        elif self._scheduler is None:
            self._scheduler = lr_scheduler
        if self._scheduler is not None and not callable(lr_scheduler) and self._optimizer is not given:
            # The engine returned its own optimizer object over the same param_groups (Horovod): the
            # scheduler still sets the right learning rates but cannot see that step() ran.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        if interval == "step" and self._scheduler is not None:
            check_stepped_scheduler(self._scheduler)
        self._scheduler_mark = getattr(self._scheduler, "last_epoch", None)
        self._ft = join_groups(self) if self.cfg.fault_tolerance else None  # torchft's Manager, for the syncs
        # torch._dynamo is deferred (Session's init: lazy_import.defer_dynamo), so eager steps do not import it (1.2 s
        # of CPU here, 5 s under load: param mode's first 10 steps counted it, issue 36 item 17); what loads it (DDP's
        # constructor in grad mode, torch.compile) ran above, inside setup_time_s
        self._start_clock()
        if lr_scheduler is not None:
            return self._model, self._optimizer, self._scheduler
        return self._model, self._optimizer

    @property
    def fault_tolerance(self) -> Any:
        """The run's :class:`~distkit.ft.groups.FaultTolerance` (its ``syncs``, ``heals``), or None."""
        return self._ft

    def set_accumulation(self, steps: int) -> None:
        """Backward passes per optimizer step (``accum_grad_multiple_step``), for a script that derives it from
        the world size (nanoGPT: ``gradient_accumulation_steps //= dk.world_size``). Call it before
        :meth:`setup`: DeepSpeed and Horovod build the accumulation into the engine there. Not collective,
        but every rank must set the same value."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise UsageError(f"dk.set_accumulation(steps): steps must be an integer >= 1, got {steps!r}")
        if self._model is not None:
            raise UsageError("dk.set_accumulation() after dk.setup(): call it before setup (DeepSpeed and Horovod "
                             "build the accumulation into the engine there)")
        self._strategy.check_accumulation(steps)
        self.cfg.accum_grad_multiple_step = steps

    @property
    def accumulation(self) -> int:
        """Backward passes per optimizer step (``accum_grad_multiple_step``)."""
        return self.cfg.accum_grad_multiple_step

    def keep_in_sync(self, *modules: nn.Module) -> None:
        """Register modules that training derives from the model outside it (an EMA copy such as
        ``torch.optim.swa_utils.AveragedModel``, a teacher): in param mode their floating-point parameters
        and buffers are averaged at every sync and by :meth:`finish`, like the model's (an average of
        EMAs is the EMA of the average), and ``ranks_in_sync`` in :meth:`summary` covers them in every mode.
        Call it after :meth:`setup`, on every rank. Not collective."""
        self._require_setup("keep_in_sync()")
        refused = self._strategy.copies_refused(self._model)  # type: ignore[arg-type]
        if refused:
            raise UsageError(f"dk.keep_in_sync: {refused}")
        for m in modules:
            if not isinstance(m, nn.Module):
                raise UsageError(f"dk.keep_in_sync(module): needs torch.nn.Module objects, got {type(m).__name__}")
            self._kept.append(m)
            averager = self._strategy.averager
            if averager is not None:
                averager.keep([t for _, t in float_state(m)])

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Context for forward passes (and the loss) at the configured ``precision``: ``torch.autocast`` to
        bfloat16 ("bf16-mixed") or float16 ("16-mixed"); a no-op for "32" and on DeepSpeed, whose engine
        holds the weights in its bf16/fp16 block's dtype itself. Call ``dk.backward`` outside it."""
        p = self.cfg.precision
        if p == "32" or self._strategy.handles_precision:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16 if p == "bf16-mixed" else torch.float16)

    def _require_setup(self, call: str) -> None:
        if self._model is None:
            raise UsageError(f"dk.{call} before dk.setup(model, optimizer): call setup first")

    @property
    def model(self) -> nn.Module:
        """The wrapped model :meth:`setup` returned."""
        self._require_setup("model")
        assert self._model is not None
        return self._model

    @property
    def optimizer(self) -> Any:
        """The optimizer :meth:`setup` returned."""
        self._require_setup("optimizer")
        return self._optimizer

    @property
    def lr_scheduler(self) -> Any:
        """The LR scheduler :meth:`step` steps (the one given to :meth:`setup`, built from a factory, or
        the DeepSpeed config's ``scheduler`` block); None without one."""
        self._require_setup("lr_scheduler")
        return self._scheduler

    def unwrap(self, model: Optional[nn.Module] = None) -> nn.Module:
        """The bare ``nn.Module`` inside the engine's wrapper (DDP, DeepSpeedEngine); not collective."""
        return self._strategy.unwrap(model if model is not None else self.model)

    # -- data -------------------------------------------------------------------------------
    def dataloader(self, dataset: Any, batch_size: Optional[int] = None, shuffle: bool = True,
                   collate_fn: Optional[Callable[[list[Any]], Any]] = None, num_workers: int = 0,
                   pin_memory: bool = False, drop_last: Optional[bool] = None, **kwargs: Any) -> ShardedLoader:
        """Collective: a ``DataLoader`` over this rank's part of ``dataset`` (``data_distribution``).

        ``shard``: one global order per epoch (seed + epoch), cut into global batches of
        ``world_size * batch_size``; this rank takes its slice, so N ranks x B see what 1 rank x N*B
        sees. ``random_seed_offset``: the whole set, in this rank's own order. The incomplete last
        global batch is dropped (``drop_last=False``, shard mode, e.g. for evaluation: kept, padded as
        ``DistributedSampler`` pads it so every rank takes as many samples; :meth:`gather` drops the
        copies) and every rank gets the same number of batches (the minimum over ranks, agreed here),
        so none waits for another. ``batch_size`` is per rank (default: the config's). Batches of any structure come
        out on :attr:`device`. Passing a ``DataLoader`` re-shards it with its dataset, batch size, collate_fn,
        workers, pin_memory and (``drop_last`` None, shard mode) its ``drop_last``; else None means True."""
        loader = sharded_loader(self, dataset, batch_size, shuffle, collate_fn, num_workers, pin_memory, drop_last, **kwargs)
        self._strategy.note_loader_batch(loader.plan_sampler.plan.b)
        return loader

    def _set_gather_tail(self, real: Optional[int]) -> None:
        """(the loaders) The newest batch is the padded last global batch of a ``drop_last=False`` loader, of ``real``
        samples (None: any other batch)."""
        self._gather_keep = real

    def gather(self, data: Any) -> Any:
        """Collective: ``data`` (a tensor, or tuples, lists and dicts of tensors; per-sample rows along dim 0) from
        every rank, concatenated in rank order, on every rank: Accelerate's ``gather_for_metrics``. Right after the
        last batch of a ``dataloader(..., drop_last=False)``, the padded copies are dropped, so an evaluation's
        gathered outputs hold every sample once, in the loader's global order, and a metric over them equals the
        one-process value. Ranks may hold different numbers of rows; other dimensions and dtype must agree."""
        with self._collective("dk.gather()"):
            return gather(self, data, self._gather_keep)

    # -- per step ---------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` the engine's way (DeepSpeed: ``engine.backward``). In grad mode the
        gradient all-reduce starts during it (collective), except inside :meth:`no_sync`.

        The newest batch a :meth:`dataloader` handed out counts as this micro-step's: its samples go
        into ``num_samples`` and the time since its fetch began into ``compute_time_s`` (so batches
        of an evaluation loader count for neither).

        A loss that is NaN or infinite stops training with :class:`~distkit.errors.NonFiniteLoss` naming
        the rank and the step (``num_steps + 1``), instead of training on and saving NaN checkpoints. On
        the CPU the check runs here, on every call, before the backward pass and so before that step's
        optimizer step (``isfinite`` of a scalar: microseconds). On CUDA, reading the result here would
        make the host wait for the GPU every micro-step; the first bad step and its loss are instead
        recorded on the device (no synchronisation) and read at every ``log_every``-th :meth:`step` (the
        points where the loss is read anyway), in :meth:`finish` and before every :meth:`save`, so the
        error may come up to ``log_every`` steps after the step it names, but no checkpoint is written
        after it."""
        self._require_setup("backward()")
        check_backward(loss, self._micro, self.cfg.accum_grad_multiple_step, self._strategy)
        self._meter.backward_begins()
        self._last_loss = loss.detach()
        self._loss_watch.check(self._last_loss, self.num_steps + 1, self.rank)
        if self._scaler is not None:
            loss = self._scaler.scale(loss)
        self._strategy.backward(loss, self._model)  # type: ignore[arg-type]
        self._micro += 1
        self._meter.backward_ended()

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Context for gradient-accumulation micro-steps: backward inside it does not communicate;
        the next backward outside it reduces the accumulated gradients."""
        self._require_setup("no_sync()")
        return self._no_sync()

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        strategy, outside = self._strategy, self._strategy.outside_no_sync
        with strategy.no_sync(self._model):  # type: ignore[arg-type]
            strategy.outside_no_sync = False
            try:
                yield
            finally:
                strategy.outside_no_sync = outside

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the reduced gradients to global L2 norm ``max_norm``; returns the norm before (NaN on
        DeepSpeed, which clips inside step to ``gradient_clip``). Call between backward and step."""
        self._require_setup("clip_grad_norm()")
        self._unscale()
        return self._strategy.clip_grad_norm(self._model, self._optimizer, float(max_norm))  # type: ignore[arg-type]

    def step(self) -> None:
        """Collective: optimizer step and zero_grad, clipping to ``gradient_clip`` if set, the LR
        scheduler, and in param mode the parameter averaging when due."""
        self._require_setup("step()")
        s, model = self._strategy, self._model
        check_step(self._micro, self.cfg.accum_grad_multiple_step, s)
        self._micro = 0
        waited = s.blocked_s
        if self.cfg.gradient_clip is not None:
            self._unscale()
            s.clip_grad_norm(model, self._optimizer, self.cfg.gradient_clip)  # type: ignore[arg-type]
        if self._scheduler is not None and self._scheduler_interval == "step":
            check_scheduler_steps(self._scheduler, self._scheduler_mark)  # the script stepped it too: one line
        if self._scaler is None:
            s.step(model, self._optimizer)  # type: ignore[arg-type]
        else:
            self._unscale()
            s.step(model, ScaledOptimizer(self._optimizer, self._scaler))  # type: ignore[arg-type]
            self._scaler.update()
            self._unscaled = False
        if self._scheduler is not None and self._scheduler_interval == "step" and not s.steps_scheduler:
            self._scheduler.step()
        self._scheduler_mark = getattr(self._scheduler, "last_epoch", None)
        self.num_steps += 1
        self.num_samples += self._meter.step_ended(s.blocked_s - waited) * self.world_size
        if not startup.ended():
            self._end_startup()  # collective: the ranks meet once; timeout_s bounds every wait from now on
        if self.num_steps % self.cfg.log_every == 0:
            self._loss_watch.raise_if_bad(self.rank)  # CUDA: the device-side record of backward's check

    def _unscale(self) -> None:
        """fp16: divide the reduced gradients by the loss scale, once per step, before clipping or stepping."""
        if self._scaler is not None and not self._unscaled:
            self._strategy.wait_for_gradients(self._model, self._optimizer)  # type: ignore[arg-type]
            self._scaler.unscale_(self._optimizer)
            self._unscaled = True

    def finish(self) -> None:
        """Collective: end of training, after which every rank holds the same model state: in param mode
        the final sync (the average), in grad mode rank 0's persistent buffers (BatchNorm statistics,
        which each rank's last forward updated on its own data), the modules of :meth:`keep_in_sync` included (an
        EMA copy's BatchNorm statistics are those of the rank's model when it was copied)."""
        self._require_setup("finish()")
        self._loss_watch.raise_if_bad(self.rank)
        self._strategy.finish(self._model)  # type: ignore[arg-type]
        if self._strategy.averager is None and self.world_size > 1:  # (param mode: the final sync averaged them)
            kept = [b for m in self._kept for b in persistent_buffers(m)]
            if kept:
                self._strategy.broadcast_tensors(kept)

    # -- lifecycle ------------------------------------------------------------------------------------
    def abort(self) -> None:
        """This rank failed: make sure no other rank waits for it (MPI engines end the job). Not collective;
        call it from an ``except`` block. A later :meth:`close` then leaves without waiting for the others."""
        self._failed = True
        explain_stall()  # a peer stopped responding: name it (distkit.health.watchdog) rather than "timed out"
        exc = sys.exc_info()[1]
        lost = lost_peer_error(exc) if exc is not None else None  # a peer is gone: which (the failure line names it)
        if lost is not None:
            record_stall(self.rank, lost)  # distkit's spawner names it too
        self._strategy.abort()

    def close(self) -> None:
        """Leave the process group; idempotent (also runs at interpreter exit).

        Collective after a normal run: the ranks leave together (a barrier, bounded by
        ``distributed.timeout_s``), since a rank that tears gloo down while a peer still finishes the
        last exchange has been seen to end that peer with "terminate called" (SIGABRT). After
        :meth:`abort` (an exception) it leaves at once.
        """
        atexit.unregister(self.close)
        if self._clip_restore is not None:
            self._clip_restore()
            self._clip_restore = None
        if Session.current is self:
            Session.current = None
            set_current_strategy(None)
        together = not self._failed and not self._closed and self._meet_at_end()  # (Job: the ranks meet)
        self._closed = True
        if self._ft is not None:  # leave the quorum: the other groups need not wait for this one's heartbeat
            self._ft = self._ft.shutdown()
        # drop the wrapped model first: a DDP wrapper freed only after the process group is gone releases
        # the group's last reference at interpreter exit (see DDPStrategy.teardown)
        self._model = self._optimizer = self._scheduler = None
        self._leave(together)  # (Job: the watchdog, the engine's teardown, this host's other ranks)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, kind: Optional[type[BaseException]], exc: Optional[BaseException], tb: Any) -> None:
        if exc is not None:
            self.abort()
        self.close()


