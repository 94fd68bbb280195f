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

import argparse
import atexit
import contextlib
import math
import os
import random
import socket
import sys
import time
import warnings
from types import TracebackType
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from distkit import checkpoint, faults, ompi_leftovers, portable
from distkit.netif import host_identity
from distkit.backends import check_backend, strategy_class
from distkit.backends.base import Strategy, float_state, persistent_buffers
from distkit.components import check_device, pick_device
from distkit.config import LaunchFlags, RunConfig, load_config, resolve, split_overrides
from distkit.data import BatchPlan, PlanSampler, ShardedLoader
from distkit.env import ClusterEnv, detect
from distkit.errors import (
    CheckpointError, CollectiveTimeout, ConfigError, DistkitError, NonFiniteLoss, UsageError,
)
from distkit.evaluation import param_checksum
from distkit.launch import record_failure, record_stall, settle_if_peer
from distkit.main_process import set_current_strategy
from distkit.watchdog import explain_stall, lost_peer_error, start_watchdog

Source = Union[argparse.Namespace, dict, RunConfig, str, Sequence[str], None]

#: ``dest`` of the ``++key value`` pairs and ``--config`` files on a namespace from :func:`add_arguments`
OVERRIDES_DEST, CONFIGS_DEST = "distkit_overrides", "distkit_configs"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add distkit's command-line flags to a user's ``parser`` (and return it).

    ``--config FILE...`` (config files, later wins), ``++key value`` (any config key; parsed
    by ``parse_args`` too), ``--nprocs N``, ``--deepspeed``, ``--deepspeed_config JSON``,
    ``--local_rank/--local-rank N`` (DeepSpeed's launcher, torch.distributed.launch),
    ``--distributed_backend gloo|nccl`` (SpeechBrain). A flag the parser already has (e.g.
    from ``deepspeed.add_config_arguments`` or the LUMI script's own ``--local-rank``) is kept
    as the user defined it and read from the namespace under its usual name.
    """
    group = parser.add_argument_group("distkit")

    def add(*flags: str, **kwargs: Any) -> None:
        if not any(f in parser._option_string_actions for f in flags):  # the user's own flag wins
            group.add_argument(*flags, **kwargs)

    add("--config", dest=CONFIGS_DEST, nargs="+", action="extend", default=[], metavar="FILE",
        help="distkit config files (.py, .yaml, .json); ++key value overrides them")
    add("--nprocs", type=int, default=None, metavar="N", help="start N local ranks (ignored under a launcher)")
    add("--deepspeed", action="store_true", help="use the DeepSpeed engine")
    add("--deepspeed_config", default=None, metavar="JSON", help="DeepSpeed config file (implies --deepspeed)")
    add("--local_rank", "--local-rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS)
    add("--distributed_backend", choices=["gloo", "nccl"], default=None,
        help="torch.distributed backend (SpeechBrain's flag)")
    original = parser.parse_known_args

    def parse_known_args(args: Optional[Sequence[str]] = None, namespace: Any = None) -> Any:
        rest, pairs = split_overrides(list(sys.argv[1:] if args is None else args))
        ns, extra = original(rest, namespace)
        setattr(ns, OVERRIDES_DEST, getattr(ns, OVERRIDES_DEST, []) + pairs)
        return ns, extra

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]  # ++key value next to argparse's own
    return parser


def _from_namespace(args: argparse.Namespace, keys: dict[str, Any]) -> tuple[RunConfig, Optional[int]]:
    local_rank = getattr(args, "local_rank", None)
    local_rank = None if local_rank is None or local_rank < 0 else int(local_rank)  # LUMI's default is -1
    flags = LaunchFlags(local_rank=local_rank, distributed_backend=getattr(args, "distributed_backend", None),
                        deepspeed=bool(getattr(args, "deepspeed", False)),
                        deepspeed_config=getattr(args, "deepspeed_config", None), nprocs=getattr(args, "nprocs", None))
    overrides = list(getattr(args, OVERRIDES_DEST, [])) + list(keys.items())
    return load_config(list(getattr(args, CONFIGS_DEST, []) or []), overrides, flags), local_rank


def config_from(source: Source, **keys: Any) -> tuple[RunConfig, Optional[int]]:
    """One validated RunConfig from any accepted source (see :func:`init`), and a ``--local_rank`` if given."""
    if isinstance(source, argparse.Namespace):
        return _from_namespace(source, keys)
    if isinstance(source, RunConfig):
        if keys:
            raise UsageError("distkit.init(RunConfig, **keys): put the keys into the RunConfig, or pass a dict")
        return source, None
    if isinstance(source, str):
        return load_config([source], list(keys.items())), None
    if isinstance(source, (list, tuple)):
        return load_config([str(p) for p in source], list(keys.items())), None
    if source is None or isinstance(source, dict):
        return resolve({**(source or {}), **keys}), None
    raise UsageError(f"distkit.init() takes an argparse.Namespace, a dict, a config file path or a RunConfig, "
                     f"got {type(source).__name__}")


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
    _install_excepthook()
    cfg, local_rank = config_from(source, **keys)
    check_backend(cfg)
    check_device(cfg)  # e.g. nccl without CUDA: one line now, not a traceback per rank later
    environ = dict(os.environ)
    if local_rank is not None:  # the old torch.distributed.launch passes it only as an argument
        environ.setdefault("LOCAL_RANK", str(local_rank))
    env = env or detect(environ)
    if env.launcher == "openmpi" and env.local_rank == 0:  # so a killed mpirun's pid can serve the next one
        ompi_leftovers.clear()
    if env.launcher == "single" and cfg.nprocs > 1:
        from distkit.launch import relaunch_command, run_local

        # The ranks resolve their config again from the same command line; they check that they chose this engine.
        os.environ[LAUNCH_ENGINE_VAR] = cfg.distributed.backend
        code = run_local(relaunch_command(), cfg.nprocs, strategy_class(cfg.distributed.backend).local_launcher)
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
_HOOKED = False


def _install_excepthook() -> None:
    """Uncaught DistkitErrors print one line (no traceback) and exit with their status; an uncaught
    error of any kind first lets the engine stop the other ranks (MPI_Abort) so none waits forever."""
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Optional[TracebackType]) -> None:
        session = Session.current
        exc = _explained(exc, session)
        if session is not None:
            record_failure(session.rank, exc)
            settle_if_peer(exc, session.world_size)
        if isinstance(exc, DistkitError) and exc.agreed and session is not None:
            # every rank raised this same error at the same point (agreed by a collective): nobody waits for
            # anybody, so no abort; one line for the job, from rank 0
            if session.rank == 0:
                print(f"distkit: error: {exc}", file=sys.__stderr__ or sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(exc.exit_code)
        if session is not None and session.world_size > 1:
            with contextlib.suppress(BaseException):
                try:
                    raise exc
                except BaseException:
                    session.abort()  # prints "rank r failed: ..." and ends the job (MPI engines)
            lost = lost_peer_error(exc)  # (found by abort: at once)
            if lost is not None:
                previous(kind, exc, tb)
                exc = lost
        if isinstance(exc, DistkitError):
            named = session is None or session.world_size == 1 or f"rank {session.rank}" in str(exc)
            where = "" if named else f" (rank {session.rank})"
            # sys.__stderr__: torch.distributed's own excepthook calls this one with sys.stderr swapped for a buffer
            print(f"distkit: error{where}: {exc}", file=sys.__stderr__ or sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(exc.exit_code)
        previous(kind, exc, tb)

    sys.excepthook = hook


def _explained(exc: BaseException, session: Optional["Session"]) -> BaseException:
    """A known error of torch's whose text does not say what to do in a distkit script, as a UsageError that does."""
    if (session is not None and "Default process group has not been initialized" in str(exc)
            and not torch.distributed.is_initialized()):
        return UsageError(f"torch.distributed is not initialised on the {session.backend} engine (it talks MPI), so "
                          "torch.utils.data.DistributedSampler (or another torch.distributed call) cannot find the "
                          "world size: pass the dataset to dk.dataloader (it shards on every engine), or give "
                          "DistributedSampler num_replicas=dk.world_size, rank=dk.rank")
    return exc


class _NoModuleAttribute(UsageError, AttributeError):
    """``model.module`` on an engine that returns the model unwrapped (an AttributeError, so ``hasattr`` is False)."""


_NAMED_CLASSES: dict[type, type] = {}


def _name_missing_module(model: nn.Module) -> None:
    """Make ``model.module`` (DDP's wrapper attribute, which scripts reach for) fail with the fix in its text on
    engines that return the model itself. The model's class is swapped for a subclass that only adds that
    message; it pickles and deep-copies as the original class. (A ``module`` attribute pointing at the model
    itself would make ``hasattr(model, "module")`` true, and unwrapping loops such as Hugging Face's
    ``unwrap_model`` would never end.)"""
    base = type(model)
    if "module" in dir(model) or base in _NAMED_CLASSES.values():
        return
    if base not in _NAMED_CLASSES:
        def __getattr__(self: nn.Module, name: str) -> Any:
            if name == "module":
                raise _NoModuleAttribute(f"'{base.__name__}' object has no attribute 'module': this engine returns "
                                         "the model unwrapped; use dk.unwrap(model) for the bare model on every engine")
            return base.__getattr__(self, name)

        def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
            named = type(self)
            self.__class__ = base
            try:
                return base.__reduce_ex__(self, protocol)
            finally:
                self.__class__ = named

        _NAMED_CLASSES[base] = type(base.__name__, (base,), {"__getattr__": __getattr__, "__reduce_ex__": __reduce_ex__,
                                                             "__module__": base.__module__, "__qualname__": base.__qualname__})
    model.__class__ = _NAMED_CLASSES[base]


class Session:
    """This rank's view of the job: topology, the wrapped model/optimizer, the loop's counters.

    Made by :func:`distkit.init`. Read-only topology: ``rank``, ``world_size``, ``local_rank``,
    ``device``, ``is_main``. ``num_steps`` (optimizer steps taken) and ``num_samples`` (global
    training samples, all ranks) count what :meth:`step` saw and are restored by :meth:`load`.
    """

    #: the session of this process, if any (used by run_on_main and the exception hook)
    current: Optional["Session"] = None

    def __init__(self, cfg: RunConfig, env: ClusterEnv) -> None:
        self.cfg, self.env = cfg, env
        device = pick_device(cfg.device, env.local_rank)
        self._strategy: Strategy = strategy_class(cfg.distributed.backend)(cfg, env, device)
        self._strategy.init()
        self._watchdog = start_watchdog(self._strategy, cfg.distributed.timeout_s)  # names a stalled rank
        # every rank's (host name, host identity), in rank order: one object all-gather at start-up; the
        # identity tells apart hosts that share a name (containers, network namespaces)
        me = (socket.gethostname(), host_identity())
        self._rank_hosts: list[tuple[str, str]] = (self._strategy.all_gather_object(me) if env.is_distributed
                                                   else [me])
        Session.current = self
        set_current_strategy(self._strategy)
        atexit.register(self.close)
        if self.is_main:
            for note in cfg.notes:
                print(f"distkit: {note}", flush=True)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        self._model: Optional[nn.Module] = None
        self._optimizer: Any = None
        self._scheduler: Any = None
        self._failed = self._closed = False
        self.num_steps, self.num_samples = 0, 0
        #: training samples per step of the run a checkpoint from another layout was written by (set by load)
        self.resumed_global_batch: Optional[int] = None
        #: the run this session's checkpoints belong to (``distkit train`` sets it: recorded in each manifest,
        #: ``config.resolved.json`` and ``summary.json``); None in the own-loop API unless the script sets it
        self.run_id: Optional[str] = None
        self._pending_samples = 0  # local samples of this step's micro-batches (those a backward used)
        self._last_batch: Optional[tuple[int, float]] = None  # (samples, fetch start) of the newest batch
        self._t_batch: Optional[float] = None  # when fetching this step's first micro-batch began
        self.compute_time_s = 0.0
        #: seconds this rank was blocked on the training collectives (gradient all-reduce, averaging):
        #: excluded from compute_time_s
        self.comm_wait_s = 0.0
        self._step_wait_s = 0.0  # of the step in progress
        self._t_grad_ready: Optional[float] = None  # when the newest gradient was accumulated
        self._t_created = self._t_start = time.perf_counter()
        self._setup_time_s = 0.0  # init to the end of setup (summary's setup_time_s)
        #: per checkpoint, in order: seconds this process was blocked in save (or save_async + commit)
        self.checkpoint_stalls_s: list[float] = []
        self._unscaled = False  # 16-mixed: this step's gradients were already unscaled (by clip_grad_norm)
        self._last_loss: Optional[torch.Tensor] = None
        # CUDA only (see _check_loss): the first step whose loss was not finite (0: none yet) and that loss,
        # kept on the device so that checking costs no host synchronisation per step
        self._bad_step: Optional[torch.Tensor] = None
        self._bad_loss: Optional[torch.Tensor] = None
        self._micro = 0  # backward passes since the last step
        self._kept: list[nn.Module] = []  # keep_in_sync
        self._given_optimizer: Any = None  # the optimizer the user passed to setup (the engine may return another)
        self._clip_restore: Optional[Callable[[], None]] = None
        # fp16 autocast needs loss scaling; bf16 does not; DeepSpeed does its own (its bf16/fp16 blocks)
        self._scaler: Optional[torch.amp.GradScaler] = None
        if cfg.precision == "16-mixed" and not self._strategy.handles_precision:
            self._scaler = torch.amp.GradScaler(self.device.type)

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

    @property
    def forward_is_collective(self) -> bool:
        """True where a forward pass communicates (ZeRO-3 gathers parameters in it): an evaluation
        loop must then run the same number of forward passes on every rank."""
        return self._model is not None and self._strategy.forward_is_collective(self._model)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only (always flushed; a ``flush`` argument is accepted and ignored)."""
        kwargs.pop("flush", None)
        if self.is_main:
            print(*args, **kwargs, flush=True)

    # -- setup ----------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: Any = None, lr_scheduler: Any = None) -> Any:
        """Collective: rank 0's initial state everywhere, model and optimizer wrapped for the engine and mode.

        ``optimizer``: a torch optimizer over ``model``'s parameters, a factory ``params -> Optimizer``
        (called only when the engine's config does not define one), or None where the DeepSpeed config
        has an ``optimizer`` block. ``lr_scheduler`` (optional): a scheduler over that optimizer, or a factory
        ``optimizer -> scheduler`` (called with the engine's optimizer; DeepSpeed calls it itself), stepped
        once per :meth:`step`.
        Returns ``(model, optimizer)``, or ``(model, optimizer, lr_scheduler)`` when one was given;
        use the returned objects from here on. One model per session.
        """
        if self._model is not None:
            raise UsageError("dk.setup() was already called: one model and optimizer per distkit session "
                             "(wrap several modules in one nn.Module)")
        if not isinstance(model, nn.Module):
            raise UsageError(f"dk.setup(model, ...) needs a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise UsageError(f"dk.setup(model, optimizer): optimizer must be a torch.optim.Optimizer, a "
                                 f"factory params -> Optimizer, or None; got {type(optimizer).__name__}")
            optimizer = None if self._strategy.engine_defines_optimizer() else optimizer(model.parameters())
        if optimizer is None and not self._strategy.engine_defines_optimizer():
            raise UsageError("dk.setup(model, None): no optimizer; pass one (only a DeepSpeed config with an "
                             "'optimizer' block may leave it out)")
        given = optimizer
        self._given_optimizer = given
        self._model, self._optimizer = self._strategy.setup(model, optimizer, lr_scheduler)
        if not hasattr(self._model, "module"):
            _name_missing_module(self._model)
        if not self._strategy.grads_in_params:
            self._guard_raw_clip()
        if self._strategy.reduces_in_backward:  # DDP/DeepSpeed wait for the all-reduce inside backward
            for p in self.unwrap().parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._gradient_ready)
        self._scheduler = getattr(self._strategy, "lr_scheduler", None)
        if self._scheduler is None and callable(lr_scheduler):  # a factory: over the optimizer the engine returned
            self._scheduler = lr_scheduler(self._optimizer)
        elif self._scheduler is None:
            self._scheduler = lr_scheduler
        if self._scheduler is not None and not callable(lr_scheduler) and self._optimizer is not given:
            # The engine returned its own optimizer object over the same param_groups (Horovod): the
            # scheduler still sets the right learning rates but cannot see that step() ran.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        self._t_start = time.perf_counter()
        self._setup_time_s = self._t_start - self._t_created
        if lr_scheduler is not None:
            return self._model, self._optimizer, self._scheduler
        return self._model, self._optimizer

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
        if self.forward_is_collective:
            raise UsageError("dk.keep_in_sync: under ZeRO-3 the model's parameters are partitioned, so a copy made from "
                             "it (AveragedModel, deepcopy) holds empty tensors: build the copy inside "
                             "deepspeed.zero.GatheredParameters(model.parameters()), or use ZeRO stage 0-2")
        for m in modules:
            if not isinstance(m, nn.Module):
                raise UsageError(f"dk.keep_in_sync(module): needs torch.nn.Module objects, got {type(m).__name__}")
            self._kept.append(m)
            averager = self._strategy.averager
            if averager is not None:
                averager.extra.extend(t for _, t in float_state(m))

    def _guard_raw_clip(self) -> None:
        """Where ``param.grad`` does not hold the gradient the engine steps with (ZeRO's partitions), a kept
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), x)`` would see no gradient and never clip: it
        raises UsageError naming the fix instead (for the set-up model's parameters only, while this
        session is open). Restored by :meth:`close`."""
        import torch.nn.utils as nn_utils
        import torch.nn.utils.clip_grad as clip_module

        original = clip_module.clip_grad_norm_
        ids = {id(p) for p in self.unwrap().parameters()}
        session = self

        def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            if Session.current is session and any(id(p) in ids for p in params):
                raise UsageError(f"torch.nn.utils.clip_grad_norm_ on the model's parameters sees no gradients on "
                                 f"{session._strategy.backend_impl()} (the engine keeps them partitioned) and would "
                                 f"never clip: remove the call and set gradient_clip = {float(max_norm):g} (the engine "
                                 "clips inside dk.step), or call dk.clip_grad_norm")
            return original(params, max_norm, *args, **kwargs)

        nn_utils.clip_grad_norm_ = clip_module.clip_grad_norm_ = clip_grad_norm_  # type: ignore[assignment]

        def restore() -> None:
            nn_utils.clip_grad_norm_ = clip_module.clip_grad_norm_ = original  # type: ignore[assignment]

        self._clip_restore = restore

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
                   pin_memory: bool = False, **kwargs: Any) -> ShardedLoader:
        """Collective: a ``DataLoader`` over this rank's part of ``dataset`` (``data_distribution``).

        ``shard``: one global order per epoch (seed + epoch), cut into global batches of
        ``world_size * batch_size``; this rank takes its slice, so N ranks x B see what 1 rank x N*B
        sees. ``random_seed_offset``: the whole set, in this rank's own order. The incomplete last
        global batch is dropped and every rank gets the same number of batches (the minimum over
        ranks, agreed here), so none waits for another. ``batch_size`` is per rank (default: the
        config's). Batches of any structure come out on :attr:`device`. Passing a ``DataLoader``
        re-shards it with its dataset, batch size, collate_fn, workers and pin_memory.
        """
        if not kwargs.pop("drop_last", True):
            raise UsageError("dk.dataloader(drop_last=False): distkit always drops the incomplete last global batch, "
                             "so that every rank takes the same number of steps; remove drop_last")
        if isinstance(dataset, DataLoader):
            loader = dataset
            dataset = loader.dataset
            if batch_size is None:
                batch_size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
            shuffle = isinstance(loader.sampler, RandomSampler)
            collate_fn = collate_fn or loader.collate_fn
            num_workers, pin_memory = loader.num_workers, loader.pin_memory
        batch_size = self.cfg.batch_size if batch_size is None else batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UsageError(f"dk.dataloader: batch_size must be an integer >= 1, got {batch_size!r}")
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise UsageError("dk.dataloader needs a map-style dataset (with __len__ and __getitem__), got "
                             f"{type(dataset).__name__}")
        plan = BatchPlan(len(dataset), batch_size, self.rank, self.world_size, self.cfg.data_distribution,
                         self.cfg.seed, shuffle=shuffle)
        # Ranks may hold different data (per-rank datasets): the minimum never hangs.
        steps = int(self.all_reduce(torch.tensor([plan.steps_per_epoch]), op="min").item())
        if steps == 0:  # (the same on every rank: agreed by the all-reduce above)
            error = UsageError(f"dk.dataloader: {len(dataset)} samples make no full global batch of "
                               f"{batch_size} x {self.world_size} ranks: use a smaller batch_size")
            error.agreed = True
            raise error
        return ShardedLoader(dataset, PlanSampler(plan, steps), self.device, collate_fn=collate_fn,
                             num_workers=num_workers, pin_memory=pin_memory, on_batch=self._batch_handed_out,
                             **kwargs)

    def _batch_handed_out(self, n: int, t_fetch: float) -> None:
        # Counted only when a backward uses it (see backward): batches of an evaluation loader are not training.
        self._last_batch = (n, t_fetch)

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
        k = self.cfg.accum_grad_multiple_step
        if self._strategy.fixed_accumulation and self._micro >= k:
            raise UsageError(f"dk.backward: {self._micro + 1} backward passes before dk.step(), but the "
                             f"{self.backend} engine takes exactly accum_grad_multiple_step = {k} per step: set "
                             "accum_grad_multiple_step to the passes per step (config, or dk.set_accumulation(n) "
                             "before dk.setup)")
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UsageError(f"dk.backward(loss) needs a scalar tensor, got {shape}: reduce it first, e.g. loss.mean()")
        n, t_fetch = self._last_batch if self._last_batch is not None else (0, time.perf_counter())
        self._last_batch = None
        self._pending_samples += n
        if self._t_batch is None:
            self._t_batch = t_fetch
        self._last_loss = loss.detach()
        self._check_loss(self._last_loss)
        if self._scaler is not None:
            loss = self._scaler.scale(loss)
        self._t_grad_ready = None
        waited = self._strategy.blocked_s
        self._strategy.backward(loss, self._model)  # type: ignore[arg-type]
        self._micro += 1
        self._step_wait_s += self._strategy.blocked_s - waited  # engines that wait for their reduction in backward
        if self._t_grad_ready is not None:
            # The engine waited for its all-reduce inside backward: from the last gradient computed to
            # the return is waiting on communication (DDP's reducer finalising its buckets).
            self._step_wait_s += max(0.0, time.perf_counter() - self._t_grad_ready)

    def _check_loss(self, loss: torch.Tensor) -> None:
        """NonFiniteLoss if ``loss`` (detached, scalar) is NaN or infinite: at once on the CPU; on other
        devices only recorded, for :meth:`_raise_if_loss_was_bad` (see :meth:`backward`)."""
        step = self.num_steps + 1
        if loss.device.type == "cpu":
            if not bool(torch.isfinite(loss)):
                raise self._non_finite(float(loss), step)
            return
        if self._bad_step is None:
            self._bad_step = torch.zeros((), dtype=torch.long, device=loss.device)
            self._bad_loss = torch.zeros((), dtype=torch.float32, device=loss.device)
        assert self._bad_loss is not None
        # only the first bad step is kept: the later ones follow from it
        first = ~torch.isfinite(loss) & (self._bad_step == 0)
        self._bad_step = torch.where(first, torch.full_like(self._bad_step, step), self._bad_step)
        self._bad_loss = torch.where(first, loss.float(), self._bad_loss)

    def _raise_if_loss_was_bad(self) -> None:
        """NonFiniteLoss for the first non-finite loss recorded on the device (CUDA), if any: reads two
        scalars, a host synchronisation, so only called at log points, in finish and before a save."""
        if self._bad_step is not None and self._bad_loss is not None:
            step = int(self._bad_step)
            if step:
                raise self._non_finite(float(self._bad_loss), step)

    def _non_finite(self, value: float, step: int) -> NonFiniteLoss:
        what = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return NonFiniteLoss(f"rank {self.rank}: the loss is {what} at step {step}: training stopped; no "
                             "checkpoint of this step or later is written (lower the learning_rate, set gradient_clip, or check "
                             "the data and the loss for nan/inf)")

    def _gradient_ready(self, _param: torch.Tensor) -> None:
        self._t_grad_ready = time.perf_counter()

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Context for gradient-accumulation micro-steps: backward inside it does not communicate;
        the next backward outside it reduces the accumulated gradients."""
        self._require_setup("no_sync()")
        return self._strategy.no_sync(self._model)  # type: ignore[arg-type]

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
        k = self.cfg.accum_grad_multiple_step
        if s.fixed_accumulation and 0 < self._micro < k:
            raise UsageError(f"dk.step() after {self._micro} backward pass(es), but the {self.backend} engine takes "
                             f"exactly accum_grad_multiple_step = {k} per step: set accum_grad_multiple_step = "
                             f"{self._micro} (config, or dk.set_accumulation({self._micro}) before dk.setup)")
        self._micro = 0
        waited = s.blocked_s
        if self.cfg.gradient_clip is not None:
            self._unscale()
            s.clip_grad_norm(model, self._optimizer, self.cfg.gradient_clip)  # type: ignore[arg-type]
        if self._scaler is None:
            s.step(model, self._optimizer)  # type: ignore[arg-type]
        else:
            self._unscale()
            s.step(model, _ScaledOptimizer(self._optimizer, self._scaler))  # type: ignore[arg-type]
            self._scaler.update()
            self._unscaled = False
        if self._scheduler is not None and not s.steps_scheduler:
            self._scheduler.step()
        self.num_steps += 1
        self.num_samples += self._pending_samples * self.world_size
        self._pending_samples = 0
        self._step_wait_s += s.blocked_s - waited
        if self._t_batch is not None:
            self.compute_time_s += time.perf_counter() - self._t_batch - self._step_wait_s
            self._t_batch = None
        self.comm_wait_s += self._step_wait_s
        self._step_wait_s = 0.0
        if self.num_steps % self.cfg.log_every == 0:
            self._raise_if_loss_was_bad()  # CUDA: the device-side record of backward's check

    def _unscale(self) -> None:
        """fp16: divide the reduced gradients by the loss scale, once per step, before clipping or stepping."""
        if self._scaler is not None and not self._unscaled:
            self._strategy.wait_for_gradients(self._model, self._optimizer)  # type: ignore[arg-type]
            self._scaler.unscale_(self._optimizer)
            self._unscaled = True

    def finish(self) -> None:
        """Collective: end of training, after which every rank holds the same model state: in param mode
        the final sync (the average), in grad mode rank 0's persistent buffers (BatchNorm statistics,
        which each rank's last forward updated on its own data)."""
        self._require_setup("finish()")
        self._raise_if_loss_was_bad()
        self._strategy.finish(self._model)  # type: ignore[arg-type]

    # -- collectives ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """Name the collective in a timeout (gloo reports only "timed out")."""
        try:
            yield
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise CollectiveTimeout(
                    f"{what} timed out after distributed.timeout_s = {self.cfg.distributed.timeout_s:g} s: a rank "
                    "did not call it (every rank must call collectives in the same order) or hung or died") from e
            raise

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

    # -- checkpoints ------------------------------------------------------------------------------
    def _engine_state(self) -> dict[str, Any]:
        return self._strategy.state_dict(self._model, self._optimizer)  # type: ignore[arg-type]

    def _internal_state(self) -> dict[str, Any]:
        averager = self._strategy.averager
        return {"averager": averager.state_dict() if averager is not None else None,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
                "progress": {"step": self.num_steps, "samples": self.num_samples}}

    def save(self, path: str, state: dict[str, Any]) -> str:
        """Collective: write ``state`` as checkpoint directory ``path``, atomically (see
        :func:`distkit.checkpoint.write`); returns its absolute path.

        Values that are the set-up model and optimizer go into the engine-neutral ``portable/`` part
        (grad mode: each tensor written once, by one rank) and, in param mode, where replicas differ,
        into each rank's own file too; DeepSpeed adds its own checkpoint files. Other values with
        a ``state_dict()`` are saved through it; anything else is pickled as is. distkit adds its own
        counters, the averager and the RNG states, which :meth:`load` restores. Each rank writes its
        own file (ranks differ in param mode and in RNG state).
        """
        t0 = time.perf_counter()
        try:
            return self._start_save(path, state, background=False).commit()
        finally:
            self.checkpoint_stalls_s.append(time.perf_counter() - t0)

    def save_async(self, path: str, state: dict[str, Any]) -> checkpoint.PendingCheckpoint:
        """Collective: start writing ``state`` as checkpoint ``path`` (as :meth:`save`) and return as soon
        as the state is copied aside in CPU memory (and, on DeepSpeed, the engine's own files are written);
        training may go on while a background thread writes the files. ``pending.commit()`` (collective,
        every rank, e.g. before the next save) waits for them and completes the checkpoint, returning its
        path; until then it does not exist (a kill leaves the previous ones). Memory: one more copy of
        this rank's checkpoint state until the files are written."""
        t0 = time.perf_counter()
        pending = self._start_save(path, state, background=True)
        self.checkpoint_stalls_s.append(time.perf_counter() - t0)
        index = len(self.checkpoint_stalls_s) - 1

        def count_commit(seconds: float) -> None:  # waiting for the files is this checkpoint's stall too
            self.checkpoint_stalls_s[index] += seconds

        pending.on_commit = count_commit
        return pending

    def _start_save(self, path: str, state: dict[str, Any], background: bool) -> checkpoint.PendingCheckpoint:
        if not isinstance(state, dict):
            raise UsageError(f"dk.save(path, state): state must be a dict, got {type(state).__name__}")
        self._raise_if_loss_was_bad()  # CUDA: never save the model of a run whose loss already diverged
        # Grad mode: the replicas are equal, and the portable part holds them once, each tensor written
        # by one rank; the rank files then carry no model or optimizer (no rank gathers a ZeRO-3 model,
        # and the N copies are not written). Param mode: the replicas differ between syncs, each rank
        # file keeps its own (the portable part has rank 0's only).
        engine: dict[str, Any] = {}
        if self._model is not None:
            engine = (self._engine_state() if self.cfg.distributed.reduce_type == "param"
                      else {"model": None, "optimizer": None})
        out: dict[str, Any] = {}
        for key, value in state.items():
            if self._model is not None and value is self._model:
                out[key] = engine["model"]
            elif self._model is not None and value is self._optimizer:
                out[key] = engine["optimizer"]
            elif hasattr(value, "state_dict") and callable(value.state_dict):
                out[key] = value.state_dict()
            else:
                out[key] = value
        out["distkit"] = self._internal_state()
        # in the manifest: a resume checks them before anything is restored
        shapes = checkpoint.model_shapes(self.unwrap()) if self._model is not None else None
        return checkpoint.start(self._strategy, path, out, self._model, step=self.num_steps, shapes=shapes,
                                samples=self.num_samples, portable_part=self._portable_part(state, out),
                                global_batch=self.global_batch, background=background, run_id=self.run_id)

    @property
    def global_batch(self) -> Optional[int]:
        """Training samples per optimizer step, all ranks together (None before the first step)."""
        return self.num_samples // self.num_steps if self.num_steps else None

    def _portable_part(self, state: dict[str, Any], out: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Collective (ZeRO): this rank's share of the engine-neutral state (see :mod:`distkit.portable`)
        and rank 0's ``meta``. In grad mode the tensors are dealt out to the ranks; in param mode the
        ranks differ between syncs and rank 0's replica is written."""
        model_key = next((k for k, v in state.items() if self._model is not None and v is self._model), None)
        opt_key = next((k for k, v in state.items() if self._optimizer is not None and v is self._optimizer), None)
        tensors: dict[str, torch.Tensor] = {}
        groups: list[dict[str, Any]] = []
        scalars: dict[str, dict[str, Any]] = {}
        if model_key is not None:
            sizes = {k: math.prod(v) for k, v in checkpoint.model_shapes(self.unwrap()).items()}
            owner = (portable.deal(sizes, self.world_size) if self.cfg.distributed.reduce_type == "grad"
                     else dict.fromkeys(sizes, 0))
            sd, optim_state, groups = self._strategy.portable_state(
                self._model, self._optimizer if opt_key else None,  # type: ignore[arg-type]
                lambda name: owner.get(name, 0) == self.rank)
            tensors, scalars = portable.flatten(sd, optim_state)
            if self.world_size > 1:  # optimizer values that are not tensors live in rank 0's meta
                for part in self._strategy.all_gather_object(scalars):
                    scalars.update(part)
        averager, averager_counters = self._strategy.averager, None
        if averager is not None:  # param mode: the same on every rank; rank 0 writes it
            averager_tensors, averager_counters = averager.portable_state(keep=self.rank == 0)  # collective under ZeRO
            tensors.update({f"{portable.AVERAGER}/{k}": v for k, v in averager_tensors.items()})
        meta = {"format": 1, "model_key": model_key, "optimizer_key": opt_key, "optim_groups": groups,
                "optim_scalars": scalars, "engine": self._strategy.name, "world_size": self.world_size,
                "reduce_type": self.cfg.distributed.reduce_type,
                "progress": {"step": self.num_steps, "samples": self.num_samples, "global_batch": self.global_batch},
                "averager": averager_counters, "entries": {k: v for k, v in out.items() if k not in (model_key, opt_key, "distkit")}}
        hf = getattr(self.unwrap(), "config", None) if model_key is not None else None
        if hf is not None and callable(getattr(hf, "to_dict", None)):  # a Hugging Face model: for `distkit export DIR/`
            meta["hf_config"] = {**hf.to_dict(), "architectures": [type(self.unwrap()).__name__]}
        return tensors, meta

    def load(self, path: str, state: dict[str, Any]) -> dict[str, Any]:
        """Collective: restore ``state``'s objects in place from checkpoint ``path`` (the set-up model,
        optimizer and scheduler, and anything with ``load_state_dict``), plus distkit's counters,
        averager and RNG states. Returns the checkpoint's other entries (e.g. ``{"epoch": 3}``).

        This rank's file is verified against the manifest (size, sha256) first; a checkpoint written by
        another number of ranks, or whose parameter shapes do not fit the set-up model, raises
        ConfigError naming both before anything is restored."""
        if not isinstance(state, dict):
            raise UsageError(f"dk.load(path, state): state must be a dict, got {type(state).__name__}")
        if self._model is not None:
            checkpoint.check_fits(path, self.world_size, lambda: checkpoint.model_shapes(self.unwrap()))
        manifest = checkpoint.read_manifest(path)
        if not self._same_layout(manifest):
            return self._load_portable(path, manifest, state)
        self.resumed_global_batch = manifest.get("global_batch")
        saved = checkpoint.load(path, self.rank, self.world_size)
        if "distkit" not in saved and "progress" in saved:  # written before the Session existed (0.1.0)
            saved["distkit"] = {k: saved.pop(k) for k in ("averager", "rng", "progress")}
        model_key = next((k for k, v in state.items() if v is self._model and v is not None), None)
        opt_key = next((k for k, v in state.items() if v is self._optimizer and v is not None), None)
        if model_key is not None:
            self._strategy.load_engine_files(path, self._model)  # type: ignore[arg-type]
            if saved.get(model_key) is None and not self._strategy.engine_files:
                # grad mode: the rank files hold no replica; the portable part has it (exactly: fp32 as trained)
                self._restore_portable(self._read_portable(path), opt_key)
            else:
                engine = {"model": saved.get(model_key), "optimizer": saved.get(opt_key) if opt_key else None}
                self._strategy.load_state_dict(self._model, self._optimizer, engine)  # type: ignore[arg-type]
        rest = {}
        for key, value in saved.items():
            if key in (model_key, opt_key, "distkit"):
                continue
            target = state.get(key)
            if target is not None and hasattr(target, "load_state_dict") and callable(target.load_state_dict):
                target.load_state_dict(value)
            else:
                rest[key] = value
        internal = saved["distkit"]
        if self._strategy.averager is not None and internal.get("averager") is not None:
            self._strategy.averager.load_state_dict(internal["averager"])
        torch.set_rng_state(internal["rng"]["torch"])
        random.setstate(internal["rng"]["python"])
        np.random.set_state(internal["rng"]["numpy"])
        self.num_steps, self.num_samples = internal["progress"]["step"], internal["progress"]["samples"]
        self._relink_given_optimizer()
        return rest

    def _relink_given_optimizer(self) -> None:
        """After a load: where the engine returned its own optimizer object over the user's param groups
        (Horovod), ``load_state_dict`` gave it new group dicts; a scheduler (or script) holding the user's
        optimizer must keep setting the learning rate the engine steps with, so the user's object shares them."""
        given, opt = self._given_optimizer, self._optimizer
        if (isinstance(given, torch.optim.Optimizer) and isinstance(opt, torch.optim.Optimizer) and given is not opt
                and given.param_groups is not opt.param_groups):
            given.param_groups = opt.param_groups
            given.state = opt.state

    @staticmethod
    def _read_portable(path: str) -> dict[str, Any]:
        """The portable part of checkpoint ``path``, verified against the manifest first."""
        problem = checkpoint.verify(path, under=portable.DIR)
        if problem:
            raise CheckpointError(f"checkpoint '{path}' is damaged: {problem}; resume from another checkpoint "
                                  "(++resume auto falls back to the newest complete one)")
        return portable.read(path)

    def _restore_portable(self, entries: dict[str, Any], opt_key: Optional[str]) -> None:
        """Collective (ZeRO): the set-up model, and the optimizer when ``opt_key`` names it and the
        checkpoint holds one, from a checkpoint's portable ``entries``."""
        meta = entries[portable.META]
        with self._collective("loading the checkpoint's portable part"):
            self._strategy.load_portable_state(
                self._model, self._optimizer if opt_key and meta["optimizer_key"] else None,  # type: ignore[arg-type]
                portable.model_state(entries), portable.optimizer_state(entries), meta["optim_groups"])

    def _same_layout(self, manifest: dict[str, Any]) -> bool:
        """Whether checkpoint ``manifest`` was written by this engine, mode, ZeRO stage and number of
        ranks (then each rank's own file and the engine's files restore it exactly)."""
        d = self.cfg.distributed
        return (manifest["world_size"] == self.world_size and manifest.get("engine") in (None, self._strategy.name)
                and manifest.get("reduce_type") in (None, d.reduce_type)
                and manifest.get("zero_stage") == getattr(self._strategy, "zero_stage", None))

    def _load_portable(self, path: str, manifest: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        """Restore ``state`` from the portable part of a checkpoint another engine, world size, mode or
        ZeRO stage wrote (see :mod:`distkit.portable`); RNG states come from the rank of the same
        number when the writer had one. Param mode's averager continues the writer's period (steps since
        the last sync, the outer optimizer's anchor and momentum) when the writer was in param mode too,
        else it starts a new period from the loaded weights."""
        entries = self._read_portable(path)
        meta = entries[portable.META]
        model_key = next((k for k, v in state.items() if v is self._model and v is not None), None)
        opt_key = next((k for k, v in state.items() if v is self._optimizer and v is not None), None)
        if model_key is not None:
            self._restore_portable(entries, opt_key)
        rest = {}
        for key, value in meta["entries"].items():
            target = state.get(key)
            if target is not None and hasattr(target, "load_state_dict") and callable(target.load_state_dict):
                target.load_state_dict(value)
            else:
                rest[key] = value
        averager = self._strategy.averager
        if averager is not None and meta.get("averager") is not None:
            with self._collective("loading the averager's state from the checkpoint's portable part"):
                averager.load_portable_state(portable.averager_state(entries), meta["averager"])
        elif averager is not None:
            averager.restart()
        if os.path.isfile(os.path.join(path, f"rank-{self.rank:05d}.pt")):  # (a converted checkpoint has none)
            own = torch.load(os.path.join(path, f"rank-{self.rank:05d}.pt"), map_location="cpu", weights_only=False, mmap=True)
            rng = (own.get("distkit") or own).get("rng")
            if rng is not None:
                torch.set_rng_state(rng["torch"])
                random.setstate(rng["python"])
                np.random.set_state(rng["numpy"])
        progress = meta["progress"]
        self.num_steps, self.num_samples = progress["step"], progress["samples"]
        self.resumed_global_batch = progress.get("global_batch")
        zs = manifest.get("zero_stage")
        was = f"{manifest.get('engine', '?')}{f' ZeRO-{zs}' if zs is not None else ''}"
        zs = getattr(self._strategy, "zero_stage", None)
        now = f"{self._strategy.name}{f' ZeRO-{zs}' if zs is not None else ''}"
        n, m = manifest["world_size"], self.world_size
        self._relink_given_optimizer()
        self.print(f"distkit: checkpoint {os.path.basename(path)} was written by {was} on {n} rank{'s' * (n != 1)} in "
                   f"{manifest.get('reduce_type', '?')} mode; loaded its portable part into {now} on {m} rank{'s' * (m != 1)} "
                   f"in {self.cfg.distributed.reduce_type} mode")
        return rest

    # -- report -------------------------------------------------------------------------------------
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
        ``setup_time_s``: from :func:`init` to the end of setup (process group, engine, model wrap);
        ``total_time_s``: from :func:`init` to now. ``extra`` keys are added (the Trainer's eval results).
        """
        self._require_setup("summary()")
        s, d = self._strategy, self.cfg.distributed
        wall = time.perf_counter() - self._t_start
        loss = None
        if self._last_loss is not None:
            loss = float(self.all_reduce(self._last_loss.float().reshape(1).cpu().clone(), op="mean"))
        params = list(s.full_named_parameters(self._model))  # type: ignore[arg-type]
        checksum = param_checksum(params)
        # In sync means the whole model state: parameters and persistent buffers (BatchNorm statistics).
        buffers = [(f"buffer.{i}", b) for i, b in enumerate(persistent_buffers(self.unwrap()))]
        # ... and every module registered with keep_in_sync (an EMA copy)
        kept = [(f"kept.{i}.{n}", t) for i, m in enumerate(self._kept) for n, t in m.state_dict().items()
                if torch.is_tensor(t)]
        state = param_checksum(params + buffers + kept) if buffers or kept else checksum
        with self._collective("the checksum exchange of dk.summary()"):
            in_sync = all(c == state for c in s.all_gather_object(state))
        out = {
            "backend": d.backend, "backend_impl": s.backend_impl(), "reduce_type": d.reduce_type,
            "param_sync_step": d.param_sync_step if d.reduce_type == "param" else None,
            "world_size": self.world_size, **self.topology(), "launcher": self.env.launcher,
            "zero_stage": getattr(s, "zero_stage", None),
            "steps": self.num_steps, "samples": self.num_samples, "final_train_loss": loss,
            "eval_loss": None, "eval_accuracy": None, "best_eval_loss": None, "best_eval_step": None,
            "param_checksum": checksum, "ranks_in_sync": in_sync,
            "wall_time_s": wall, "setup_time_s": self._setup_time_s,
            "checkpoints": len(self.checkpoint_stalls_s), "checkpoint_stall_s": sum(self.checkpoint_stalls_s),
            "checkpoint_stalls_s": [round(t, 6) for t in self.checkpoint_stalls_s],
            "total_time_s": time.perf_counter() - self._t_created, "samples_per_s": self.num_samples / max(wall, 1e-9),
            "compute_fraction": self.compute_time_s / max(wall, 1e-9), "comm_wait_s": self.comm_wait_s,
            "comm_bytes": s.comm_bytes,
            "stopped_early": False, "run_id": self.run_id,
        }
        out.update(extra)
        return out

    # -- lifecycle ------------------------------------------------------------------------------------
    def abort(self) -> None:
        """This rank failed: make sure no other rank waits for it (MPI engines end the job). Not collective;
        call it from an ``except`` block. A later :meth:`close` then leaves without waiting for the others."""
        self._failed = True
        explain_stall()  # a peer stopped responding: name it (distkit.watchdog) rather than "timed out"
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
        together = False
        if not self._failed and not self._closed and self.world_size > 1:
            with contextlib.suppress(Exception):
                self._strategy.barrier()
                together = True
            faults.maybe_fire(self.rank, self.num_steps, "close")
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.stop()
        # drop the wrapped model first: a DDP wrapper freed only after the process group is gone releases
        # the group's last reference at interpreter exit (see DDPStrategy.teardown)
        self._model = self._optimizer = self._scheduler = None
        self._strategy.teardown()
        if together and self._watchdog is not None:
            # The run is over, but the job is not until every rank has left: a rank stopped now would keep
            # the launcher waiting forever once the others are gone. The lowest rank of each host sees its
            # host's ranks out (issue 23).
            self._watchdog.leave()
            killed = self._watchdog.reap_local_peers(float(self.cfg.distributed.timeout_s))
            if killed:
                names = ", ".join(str(r) for r in killed)
                print(f"distkit: rank{'s' * (len(killed) > 1)} {names} stopped responding while the job ended (after "
                      f"the last collective); ended {'them' if len(killed) > 1 else 'it'}: the run's outputs are "
                      "complete, the job exits non-zero", file=sys.__stderr__ or sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(1)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, kind: Optional[type[BaseException]], exc: Optional[BaseException], tb: Any) -> None:
        if exc is not None:
            self.abort()
        self.close()



class _ScaledOptimizer:
    """The optimizer as the engine sees it under fp16 loss scaling: ``step()`` goes through the GradScaler
    (skipped when a gradient overflowed), everything else is the optimizer's own."""

    def __init__(self, optimizer: Any, scaler: torch.amp.GradScaler) -> None:
        self._optimizer, self._scaler = optimizer, scaler

    def step(self, closure: Any = None) -> Any:
        return self._scaler.step(self._optimizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)
