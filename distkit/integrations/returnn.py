"""distkit under RETURNN's own PyTorch engine: RETURNN's ``rnn.py``/``python -m returnn`` trains, distkit's engine
and mode reduce (``pip install 'distkit[returnn]'``).

RETURNN has no engine option, but two config keys let code in: ``torch_distributed["class"]`` (in RETURNN's grad
mode, the class it wraps the model in instead of ``DistributedDataParallel``: ``returnn/torch/distributed.py``,
``DistributedContext.maybe_make_distributed_module``) and ``epoch_end`` (a function it calls on every rank at the end
of each epoch, before it saves the checkpoint). The config lines::

    import distkit.integrations.returnn
    device = "cpu"  # CPU only: with torch_distributed RETURNN asserts CUDA unless the config says "cpu"
    torch_distributed = distkit.integrations.returnn.torch_distributed(backend="mpi", reduce_type="param", param_sync_step=100)
    epoch_end = distkit.integrations.returnn.epoch_end  # param mode (required there): RETURNN's checkpoint is the ranks' mean

``torch_distributed(...)`` takes the keys of distkit's ``distributed`` block (``backend``: ddp, mpi, horovod;
``reduce_type``: "grad" or "param"; ``param_sync_step``, ``outer_optimizer``, ``param_sync_compression``, ...) and
optionally ``config``, a distkit config (file path or dict) for the rest; it returns the dict RETURNN reads:
RETURNN's own reduce_type stays "grad" (so it builds :class:`DistkitDDP`), and distkit's mode decides. Launch as
RETURNN's DDP is launched (``torchrun --nproc_per_node N -m returnn cfg.py``), or ``mpirun -np N python -m returnn
cfg.py`` (the mpi and horovod engines; ``torch_distributed`` then sets the ``RANK``/``MASTER_*`` variables RETURNN's
``init_process_group`` reads from the MPI launcher's).

What runs where:

* The engine: the first training forward makes a :class:`distkit.Session` step (``dk.setup`` of RETURNN's wrapped
  module with RETURNN's optimizer: rank 0's state everywhere, the DDP wrapper, the mpi reducer, Horovod's
  ``DistributedOptimizer`` or param mode's averager). Each training forward runs through the engine's model; RETURNN's
  ``total_loss.backward()`` reaches ``dk.backward`` (see :class:`_Handoff`), so when it returns the gradients are
  reduced, as under DDP, and RETURNN's clipping and gradient-norm logging see what every rank holds; RETURNN's
  ``optimizer.step()`` is ``dk.step()`` (param mode: the average when due); ``no_sync`` is ``dk.no_sync``.
* RETURNN's own small collectives (whether every rank still has data, the epoch's progress: a few numbers per step;
  the evaluation's broadcasts) stay on the ``torch.distributed`` group RETURNN makes (gloo on the CPU): under the
  mpi and Horovod engines that group exists beside MPI; the ddp engine adopts it as its own.
* RETURNN writes the checkpoint (rank 0's model and optimizer state): in param mode ``epoch_end`` first averages the
  replicas (parameters, floating buffers) and the optimizer state (RETURNN's param-mode rule at the end of an epoch),
  so the checkpoint is every rank's. At the periodic syncs the optimizer state stays each rank's own.
* Gradient accumulation: RETURNN enters ``no_sync`` after the forward, when DDP has decided to reduce already, so its
  DDP (and the ddp engine here, the same DDP called the same way) reduces every micro-step; the mpi and Horovod engines
  reduce each step's sum once (the same mean, rounded otherwise: about 1e-6 apart).

What it touches of RETURNN's objects (no file of RETURNN is changed): ``module.engine`` of the module RETURNN hands
the class (``Engine.get_pt_optimizer()``, ``Engine.config``), ``step`` of RETURNN's optimizer object (an instance
attribute calling ``dk.step()``), and ``total_loss`` of each training step's ``rf.RunCtx`` (an instance attribute
returning RETURNN's own sum, through :class:`_Handoff`). Refused, one line ``distkit: error: ...`` and exit 2 before
training: deepspeed and fsdp (their engines own backward and step, which RETURNN's Updater keeps), distkit's
``precision`` and ``gradient_clip`` (RETURNN's ``torch_amp`` and ``gradient_clip*`` do that), param mode without
``epoch_end``, a callable ``accum_grad_multiple_step`` under Horovod, the mpi and horovod engines under torchrun, and
on a machine without CUDA a config without ``device = "cpu"``. See docs/returnn.md.

Nothing else in distkit imports this module (it imports RETURNN).
"""
from __future__ import annotations

import contextlib
import functools
import os
import random
import sys
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

import returnn.frontend as rf
from returnn.torch.distributed import get_ctx as returnn_ctx

from distkit.config import RunConfig, load_config
from distkit.config.arguments import config_from
from distkit.backends import check_backend
from distkit.env import detect, resolve_rendezvous
from distkit.errors import ConfigError, DistkitError, UnsupportedCombination, UsageError
from distkit.session import Session, init as distkit_init

#: a distkit config as :func:`torch_distributed` takes it: a file path, a dict, or None (the defaults)
Source = Union[None, str, dict[str, Any]]
#: engines whose backward and step RETURNN's loop can drive (the others own them: refused with the reason)
ENGINES = ("ddp", "mpi", "horovod")
_OWN_LOOP = {
    "deepspeed": "DeepSpeed's engine owns backward and the optimizer step (engine.backward, engine.step), which "
                 "RETURNN's Updater does itself",
    "fsdp": "FSDP shards the parameters, but RETURNN builds its optimizer over the whole ones and saves rank 0's "
            "model.state_dict() alone",
}
#: the MPI launchers: the mpi engine needs one (Horovod also horovodrun), and under them (and horovodrun)
#: torch_distributed() sets torchrun's variables for RETURNN's init_process_group
_MPI_LAUNCHERS = ("openmpi", "mpich", "pmix")


def _refuse(error: DistkitError) -> None:
    """One line ``distkit: error: ...`` on stderr and the error's exit status (2: bad input), at once: the error
    was raised alike on every rank before training, and RETURNN would otherwise print a long traceback."""
    print(f"distkit: error: {error}", file=sys.__stderr__ or sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(error.exit_code)


def resolve(config: Source = None, **distributed: Any) -> RunConfig:
    """distkit's RunConfig from ``config`` (a distkit config file or dict; None: the defaults) with ``distributed``
    (keys of its ``distributed`` block) over it. ConfigError for unknown keys or values; UnsupportedCombination for
    what RETURNN's loop cannot drive. Not collective."""
    if isinstance(config, str):
        cfg = load_config([config], [(f"distributed.{k}", v) for k, v in distributed.items()])
    elif config is None or isinstance(config, dict):
        source = dict(config or {})
        source["distributed"] = {**dict(source.get("distributed") or {}), **distributed}
        cfg, _ = config_from(source)
    else:
        raise ConfigError(f"distkit.integrations.returnn.torch_distributed(config=...): a distkit config file path or dict, got "
                          f"{type(config).__name__}")
    d = cfg.distributed
    if d.backend not in ENGINES:
        why = _OWN_LOOP.get(d.backend, "it is no engine RETURNN's loop can drive")
        raise UnsupportedCombination(f"distkit.integrations.returnn: the {d.backend} engine under RETURNN's engine: {why}; use "
                                     f"backend {', '.join(ENGINES)}, or distkit's own loop (distkit train)")
    if cfg.precision != "32":
        raise UnsupportedCombination(f"distkit.integrations.returnn: precision '{cfg.precision}': RETURNN's engine runs the "
                                     "forward; use RETURNN's torch_amp option instead (and distkit's default '32')")
    if cfg.gradient_clip is not None:
        raise UnsupportedCombination("distkit.integrations.returnn: gradient_clip: RETURNN's Updater clips (gradient_clip, "
                                     "gradient_clip_global_norm), on the reduced gradients; set it there instead")
    check_backend(cfg)
    return cfg


def torch_distributed(config: Source = None, *, dataset_distribution: str = "random_seed_offset",
                      **distributed: Any) -> dict[str, Any]:
    """The value of RETURNN's ``torch_distributed`` config key that trains on distkit's engine and mode.

    ``distributed``: keys of distkit's ``distributed`` block (``backend="mpi"``, ``reduce_type="param"``,
    ``param_sync_step=100``, ``timeout_s=300`` (seconds) ...); ``config``: a distkit config file path or dict for
    other keys (distkit leaves RETURNN's random state as RETURNN set it).
    ``dataset_distribution``: RETURNN's ("random_seed_offset": every rank all the data in its own order; "shard":
    each rank its own part). Checked here, while RETURNN reads its config, on every rank: a bad key, an engine
    RETURNN's loop cannot drive or a missing package prints one line ``distkit: error: ...`` and exits with status 2.

    Under an MPI launcher (``mpirun -np N python -m returnn cfg.py``) this also sets the variables RETURNN's
    ``init_process_group`` reads (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``) from the launcher's, where they are not set; on several hosts that agrees on rank 0's address
    through mpi4py (a collective: every rank's config runs it).
    """
    try:
        cfg = resolve(config, **distributed)
        if not torch.cuda.is_available():
            check_cpu_device(sys._getframe(1).f_globals.get("device", _UNSET), sys.argv)
        if dataset_distribution not in ("random_seed_offset", "shard"):
            raise ConfigError(f"distkit.integrations.returnn.torch_distributed: dataset_distribution must be 'random_seed_offset' "
                              f"or 'shard' (RETURNN's), got {dataset_distribution!r}")
        _check_launcher(cfg)
        _returnn_environment()
    except DistkitError as e:
        _refuse(e)
    out: dict[str, Any] = {
        "reduce_type": "grad",  # RETURNN's: it then wraps the model in "class"; distkit's reduce_type decides
        "class": DistkitDDP,
        "options": {"distkit": {"config": config, "distributed": dict(distributed)}},
        "dataset_distribution": dataset_distribution,
    }
    # The group RETURNN makes for its own collectives (its timeout_sec stays RETURNN's: the other ranks wait in it
    # while rank 0 alone evaluates). On a CUDA-less torch RETURNN's default "cpu:gloo,cuda:nccl" fails ("Distributed
    # package doesn't have NCCL built in", init_process_group in returnn/torch/distributed.py): gloo there.
    if cfg.distributed.pg_backend is not None:
        out["backend"] = cfg.distributed.pg_backend
    elif not torch.cuda.is_available():
        out["backend"] = "gloo"
    return out


_UNSET = object()


def check_cpu_device(device: Any, argv: list[str]) -> None:
    """ConfigError unless the RETURNN config (its ``device`` so far: ``device``, or ``++device cpu`` in ``argv``) asks
    for the CPU. On a machine without CUDA RETURNN's engine asserts CUDA for ``torch_distributed`` unless the config
    says ``device = "cpu"`` (``get_device_from_config`` in returnn/torch/engine.py: ``assert dev_.result == "cuda"``,
    "torch distributed: unexpected device 'cpu'") when it starts, with a traceback; this says so in one line."""
    on_line = any(a == "++device" and b == "cpu" for a, b in zip(argv, argv[1:]))
    if device == "cpu" or on_line:
        return
    got = "no device" if device is _UNSET else f"device = {device!r}"
    raise ConfigError(f"distkit.integrations.returnn: this machine has no CUDA and the RETURNN config has {got} before "
                      "torch_distributed: RETURNN's engine then asserts CUDA for torch_distributed (torch distributed: "
                      "unexpected device 'cpu'); put device = \"cpu\" above the torch_distributed line (or pass "
                      "++device cpu)")


def _check_launcher(cfg: RunConfig) -> None:
    """UnsupportedCombination where the mpi or horovod engine runs under a launcher whose ranks are no MPI processes
    (torchrun, a hand-set RANK): said here, before RETURNN starts its process group, with RETURNN's command line."""
    env = detect(dict(os.environ))
    engine = cfg.distributed.backend
    mpi_ok = _MPI_LAUNCHERS + (("horovodrun",) if engine == "horovod" else ())
    if engine in ("mpi", "horovod") and env.world_size > 1 and env.launcher not in mpi_ok:
        raise UnsupportedCombination(f"distkit.integrations.returnn: the {engine} engine needs MPI ranks, but the {env.launcher} "
                                     f"launcher started these: mpirun -np {env.world_size} python -m returnn CONFIG "
                                     "(or backend ddp under torchrun)")


def _returnn_environment() -> None:
    """Under an MPI launcher: torchrun's variables from the launcher's (detect), where unset, for RETURNN's
    ``DistributedContext`` (it reads ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` and ``init_process_group``'s ``env://``)."""
    env = detect(dict(os.environ))
    if env.launcher not in _MPI_LAUNCHERS + ("horovodrun",) or "RANK" in os.environ:
        return
    addr, port = resolve_rendezvous(env)
    for key, value in (("RANK", env.rank), ("WORLD_SIZE", env.world_size), ("LOCAL_RANK", env.local_rank),
                       ("LOCAL_WORLD_SIZE", env.local_world_size), ("MASTER_ADDR", addr), ("MASTER_PORT", port)):
        os.environ.setdefault(key, str(value))


#: the wrapper of this process (one RETURNN engine per process), for :func:`epoch_end`
_CURRENT: Optional["DistkitDDP"] = None


def session() -> Optional[Session]:
    """The :class:`distkit.Session` RETURNN's engine trains through in this process (its ``rank``, ``backend``,
    collectives, ``summary()``), or None before RETURNN made :class:`DistkitDDP` (in ``Engine.__init__``). The model and
    optimizer are set up in it from the first training step on."""
    return _CURRENT.dk if _CURRENT is not None else None


def epoch_end(*, epoch: int, step: int, model: torch.nn.Module, dataset_name: str, **kwargs: Any) -> None:
    """RETURNN's ``epoch_end`` config function: after a training epoch, in param mode, the ranks average their
    replicas (``dk.finish()``: parameters and floating buffers), so the checkpoint RETURNN then writes (rank 0's) and
    its evaluation are the mean; in grad mode rank 0's persistent buffers. Collective: RETURNN calls it on every rank
    at the end of every epoch (``dataset_name="train"``; a no-op for the evaluation sets). Chain your own with
    :func:`epoch_end_then`."""
    if dataset_name == "train" and _CURRENT is not None:
        _CURRENT.epoch_done()


def epoch_end_then(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``epoch_end = distkit.integrations.returnn.epoch_end_then(my_epoch_end)``: :func:`epoch_end`, then ``fn`` with the same
    arguments."""
    @functools.wraps(fn)
    def both(**kwargs: Any) -> Any:
        epoch_end(**kwargs)
        return fn(**kwargs)

    both._distkit_epoch_end = True  # type: ignore[attr-defined]
    return both


def _is_ours(fn: Any) -> bool:
    return fn is epoch_end or bool(getattr(fn, "_distkit_epoch_end", False))


class _Handoff(torch.autograd.Function):
    """RETURNN's total loss, as the tensor RETURNN calls ``backward()`` on: its value, and its backward runs
    ``dk.backward`` on the real loss (:meth:`DistkitDDP._backward`, a re-entrant backward, as
    ``torch.utils.checkpoint`` runs one), so the engine's backward (DDP's reducer, the mpi engine's buckets, Horovod's
    synchronize) runs whole and has finished when RETURNN's ``backward()`` returns. The gradient that reaches the
    model is RETURNN's own, bit for bit: the real loss times the incoming gradient (1.0, or a GradScaler's scale)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, value: torch.Tensor, bridge: "DistkitDDP") -> torch.Tensor:
        ctx.bridge = bridge
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.bridge._backward(grad)
        return None, None, None


class DistkitDDP:
    """The class RETURNN builds in place of ``DistributedDataParallel`` (``torch_distributed["class"]``):
    ``DistkitDDP(module=..., device_ids=..., distkit={...})``, made by RETURNN's engine before it makes its optimizer.

    Joins distkit's job here (``distkit.init``: the ddp engine adopts the process group RETURNN made; mpi and Horovod
    start their own beside it), with distkit's random seeding undone (RETURNN's random state is left as it was).
    Cross-rank contract: every rank makes it with the same options, and RETURNN then runs the same training
    forwards, backwards and optimizer steps on every rank, as its own DDP path needs; the first training forward
    is collective (``dk.setup``), and each backward and step is (grad mode; param mode: the steps).
    """

    def __init__(self, module: torch.nn.Module, device_ids: Optional[list[int]] = None, *,
                 distkit: Optional[dict[str, Any]] = None) -> None:
        global _CURRENT
        self.module = module
        try:
            options = distkit or {}
            cfg = resolve(options.get("config"), **dict(options.get("distributed") or {}))
            cfg.device = "cpu" if not device_ids else "cuda"
            engine = getattr(module, "engine", None)
            if engine is None or not hasattr(engine, "get_pt_optimizer"):
                raise UnsupportedCombination("distkit.integrations.returnn: RETURNN handed the class no module with .engine (its "
                                             f"_WrappedModuleRunStep; got {type(module).__name__}): this RETURNN "
                                             "version is not supported; use one from 2024 on")
            self._engine = engine
            self._accumulation = self._check_returnn_config(cfg, engine.config)
            self.dk: Session = _init_keeping_rng(cfg)
            ctx = returnn_ctx()
            if ctx is not None and (ctx.rank(), ctx.size()) != (self.dk.rank, self.dk.world_size):
                raise ConfigError(f"distkit.integrations.returnn: RETURNN runs rank {ctx.rank()} of {ctx.size()}, distkit's "
                                  f"{self.dk.backend} engine rank {self.dk.rank} of {self.dk.world_size}: start both "
                                  "from one launcher (torchrun, or mpirun for mpi and horovod)")
        except DistkitError as e:
            _refuse(e)
        self._param_mode = cfg.distributed.reduce_type == "param"
        self._model: Optional[torch.nn.Module] = None
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._pending: Optional[torch.Tensor] = None  # the real total loss of the step RETURNN will backward
        self._anchors: dict[torch.device, torch.Tensor] = {}
        self._in_step = False
        #: backward passes through dk.backward since the last optimizer step
        self.backwards = 0
        _CURRENT = self

    @staticmethod
    def _check_returnn_config(cfg: RunConfig, config: Any) -> Optional[int]:
        """The RETURNN config's ``accum_grad_multiple_step`` (None: a callable), after the refusals that depend on
        it and on ``epoch_end``."""
        accum = config.typed_dict.get("accum_grad_multiple_step", 1)
        if callable(accum):
            if cfg.distributed.backend == "horovod":
                raise UnsupportedCombination("distkit.integrations.returnn: a callable accum_grad_multiple_step under the horovod "
                                             "engine (Horovod counts the passes per step when it is set up): use an "
                                             "int, or the ddp or mpi engine")
            accum = None
        elif isinstance(accum, bool) or not isinstance(accum, int) or accum < 1:
            raise ConfigError(f"distkit.integrations.returnn: accum_grad_multiple_step must be an int >= 1 or a callable, got "
                              f"{accum!r}")
        if cfg.distributed.reduce_type == "param" and not _is_ours(config.typed_dict.get("epoch_end")):
            raise UsageError("distkit.integrations.returnn: reduce_type 'param' needs epoch_end = distkit.integrations.returnn.epoch_end in the "
                             "RETURNN config (or epoch_end_then(your_function)), so that the ranks average before "
                             "RETURNN saves rank 0's model")
        return accum

    # -- RETURNN calls these ---------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """RETURNN's step through the engine (training: with autograd on); evaluation (RETURNN runs it on rank 0
        alone, autograd off) calls the module's forward directly, so no engine hook communicates."""
        if not torch.is_grad_enabled():
            return self.module.forward(*args, **kwargs)
        if self._model is None:
            self._setup()
        assert self._model is not None
        out = self._model(*args, **kwargs)
        run_ctx = rf.get_run_ctx()
        if run_ctx.stage == "train_step":
            run_ctx.total_loss = functools.partial(self._total_loss, run_ctx)  # type: ignore[method-assign]
        return out

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """RETURNN's accumulation micro-steps (``accum_grad_multiple_step``): ``dk.no_sync``."""
        if self._model is None:
            return contextlib.nullcontext()
        return self.dk.no_sync()

    # -- the Session ---------------------------------------------------------------------------------------------
    def _setup(self) -> None:
        """Collective (the first training forward, every rank): ``dk.setup`` of RETURNN's module with RETURNN's
        optimizer, and RETURNN's optimizer's ``step`` routed to ``dk.step``."""
        optimizer = self._engine.get_pt_optimizer()
        if optimizer is None:
            raise UsageError("distkit.integrations.returnn: RETURNN has no optimizer at its first training step")
        if self._accumulation is not None:
            self.dk.set_accumulation(self._accumulation)
        self._model, engine_optimizer = self.dk.setup(self.module, optimizer)
        if engine_optimizer is not optimizer:
            # Horovod's DistributedOptimizer: a second object over the same param_groups; the state it steps is the
            # state RETURNN saves and loads (its resumed state went to Horovod's in dk.setup and was broadcast)
            optimizer.state = engine_optimizer.state
        self._optimizer = optimizer
        optimizer.step = self._step  # type: ignore[method-assign]

    def _total_loss(self, run_ctx: Any) -> Any:
        """RETURNN's ``RunCtx.total_loss()``, as a tensor whose backward is :meth:`_backward` (:class:`_Handoff`)."""
        total = type(run_ctx).total_loss(run_ctx)
        raw = getattr(total, "raw_tensor", None)
        if not isinstance(raw, torch.Tensor) or not raw.requires_grad:
            return total
        self._pending = raw
        anchor = self._anchors.get(raw.device)
        if anchor is None:
            anchor = self._anchors[raw.device] = torch.zeros((), device=raw.device, requires_grad=True)
        total.raw_tensor = _Handoff.apply(anchor, raw.detach(), self)
        return total

    def _backward(self, grad: torch.Tensor) -> None:
        """Inside RETURNN's ``backward()``: ``dk.backward`` on the real loss times the incoming gradient."""
        loss, self._pending = self._pending, None
        if loss is None:
            raise UsageError("distkit.integrations.returnn: a second backward through one training step's total loss")
        with torch.enable_grad():
            self.dk.backward(loss * grad.to(loss.dtype))
        self.backwards += 1

    def _step(self, closure: Any = None) -> Any:
        """RETURNN's ``optimizer.step()``: ``dk.step()`` (collective), inside which the engine steps the optimizer
        through this same attribute, which then runs the optimizer's own step."""
        optimizer = self._optimizer
        assert optimizer is not None
        if self._in_step:
            return type(optimizer).step(optimizer, closure)
        if closure is not None:
            raise UnsupportedCombination("distkit.integrations.returnn: an optimizer step with a closure (LBFGS): use a "
                                         "first-order optimizer")
        if self.backwards == 0 and not self._param_mode and self.dk.world_size > 1:
            raise UsageError("distkit.integrations.returnn: RETURNN stepped the optimizer after no backward through distkit "
                             "(RETURNN's train loop no longer takes rf.get_run_ctx().total_loss()): the gradients "
                             "are not reduced; this RETURNN version is not supported")
        self._in_step = True
        try:
            self.dk.step()
        finally:
            self._in_step = False
        self.backwards = 0
        return None

    def epoch_done(self) -> None:
        """Collective (:func:`epoch_end`), once the Session trains: ``dk.finish()``; in param mode also the optimizer
        state, by RETURNN's param-mode rule at the end of an epoch (``sync_at_epoch_end``), so that the state RETURNN
        saves (rank 0's) is every rank's and a run resumed from it continues as the uninterrupted one."""
        if self._model is None:
            return
        self.dk.finish()
        if self._param_mode and self.dk.world_size > 1:
            assert self._optimizer is not None
            average_optimizer_state(self.dk, self._optimizer)


def average_optimizer_state(dk: Session, optimizer: torch.optim.Optimizer) -> None:
    """Collective: every rank's optimizer state the same, by the rule of RETURNN's param mode at the end of an epoch
    (``_sync_state`` in returnn/torch/distributed.py): floating tensors the mean over the ranks (Adam's moments),
    counts the max (``step`` entries and integer tensors), other values rank 0's; over distkit's engine (3
    collectives). UnsupportedCombination where the ranks' states differ in layout (a parameter with state on one rank
    only): every rank raises it."""
    entries = [(i, key, value) for i, p in enumerate(q for g in optimizer.param_groups for q in g["params"])
               for key, value in sorted(optimizer.state.get(p, {}).items())]
    layout = [(i, key, (str(v.dtype), tuple(v.shape)) if torch.is_tensor(v) else type(v).__name__)
              for i, key, v in entries]
    if any(theirs != layout for theirs in dk.all_gather_object(layout)):
        raise UnsupportedCombination("distkit.integrations.returnn: the ranks' optimizer states differ in layout at the end of the "
                                     "epoch (a parameter got gradients on some ranks only), so they cannot be "
                                     "averaged: use grad mode, or a model whose every parameter trains on every rank")
    means = [v for _, key, v in entries if torch.is_tensor(v) and v.is_floating_point() and key != "step"]
    counts = [v for _, key, v in entries if torch.is_tensor(v) and not (v.is_floating_point() and key != "step")]
    with torch.no_grad():
        for dtype in sorted({t.dtype for t in means}, key=str):
            group = [t for t in means if t.dtype == dtype]
            flat = dk.all_reduce(torch.cat([t.reshape(-1) for t in group]), op="mean")
            for t, v in zip(group, torch.split(flat, [t.numel() for t in group])):
                t.copy_(v.view_as(t))
        if counts:
            flat = dk.all_reduce(torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in counts]), op="max")
            for t, v in zip(counts, torch.split(flat, [t.numel() for t in counts])):
                t.copy_(v.view_as(t).to(t.dtype))
    others = [(i, key) for i, key, v in entries if not torch.is_tensor(v)]
    if others:
        values = dk.broadcast_object([v for _, _, v in entries if not torch.is_tensor(v)], 0)
        params = [q for g in optimizer.param_groups for q in g["params"]]
        for (i, key), value in zip(others, values):
            optimizer.state[params[i]][key] = value


def _init_keeping_rng(cfg: RunConfig) -> Session:
    """``distkit.init(cfg)`` with the random state (torch, CUDA, Python, NumPy) as it was before: distkit seeds it,
    RETURNN has seeded it already."""
    states: tuple[Any, ...] = (torch.get_rng_state(), random.getstate(), np.random.get_state(),
                               torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
    try:
        return distkit_init(cfg)
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])
