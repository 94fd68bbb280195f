"""Small factories the training loop uses: the optimizer, the LR scheduler and the device.

The config layer checks names and shapes of these keys up front (:mod:`distkit.config.resolve`);
these functions build the objects once the model exists.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import re
import sys
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from distkit.config import RunConfig
from distkit.config.validate import NO_CUDA
from distkit.errors import ConfigError, UsageError

#: lr_scheduler classes distkit defines itself (HF names); anything else is a torch.optim.lr_scheduler class.
SCHEDULES = ("constant", "linear", "cosine", "step")


def _torch_classes(module: Any, base: type, exclude: tuple[str, ...]) -> dict[str, type]:
    """The subclasses of ``base`` that ``module`` exports, by lower-case name (``exclude``: abstract bases)."""
    return {n.lower(): getattr(module, n) for n in dir(module)
            if inspect.isclass(getattr(module, n)) and issubclass(getattr(module, n), base) and n not in exclude}


def optimizer_class(name: Any) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class ``name`` names, case-insensitively ("adamw", "RMSprop", "sgd"); or ``name``
    itself when it is an Optimizer subclass. ConfigError naming the nearest classes otherwise."""
    if isinstance(name, type) and issubclass(name, torch.optim.Optimizer):
        return name
    classes = _torch_classes(torch.optim, torch.optim.Optimizer, ("Optimizer",))
    found = classes.get(str(name).lower())
    if found is None and str(name).lower() == "muon":
        raise ConfigError(f"optimizer class 'muon' needs torch.optim.Muon, which torch {torch.__version__} lacks: "
                          "install torch >= 2.9, or use 'adamw'")
    if found is None:
        raise ConfigError(f"optimizer class {name!r} is not a torch.optim optimizer: use one of "
                          f"{', '.join(sorted(c.__name__ for c in classes.values()))}, or give optimizer as a "
                          "factory params -> Optimizer")
    return found  # type: ignore[return-value]


#: The (name, parameter) pairs of a model, as ``model.named_parameters()`` gives them, produced on demand.
NamedParameters = Callable[[], Iterable[tuple[str, torch.nn.Parameter]]]


def build_optimizer(cfg: RunConfig, params: Any, world_size: int = 1,
                    named_parameters: Optional[NamedParameters] = None) -> torch.optim.Optimizer:
    """The configured optimizer: ``optimizer = {"class": <torch.optim name>, **kwargs}`` with ``lr`` =
    ``learning_rate`` (times the world size with ``distributed.scale_lr``), or a factory (which sets its own
    learning rate): ``params -> Optimizer``, or one that asks for ``named_parameters`` (see
    :func:`call_optimizer_factory`; ``named_parameters`` here gives the model's pairs for it). ``"class": "muon"``
    is :func:`build_muon` (Muon on the hidden matrices, AdamW on the rest; ``named_parameters`` names them)."""
    if callable(cfg.optimizer):
        opt = call_optimizer_factory(cfg.optimizer, params, named_parameters)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"the 'optimizer' factory returned {type(opt).__name__}, not a torch.optim.Optimizer: "
                              "return e.g. torch.optim.AdamW(params, lr=1e-3)")
        return opt
    kwargs = {k: v for k, v in cfg.optimizer.items() if k != "class"}
    lr = cfg.learning_rate * (world_size if cfg.distributed.scale_lr else 1)
    cls = optimizer_class(cfg.optimizer["class"])
    if cls is getattr(torch.optim, "Muon", None):
        with _without_dynamo():
            return build_muon(cfg.optimizer, params, lr, world_size if cfg.distributed.scale_lr else 1,
                              named_parameters)
    if cls is torch.optim.LBFGS:
        # its step() needs a closure that re-runs forward and backward; the shared loop steps once per batch
        raise ConfigError("optimizer 'LBFGS' needs a closure, which distkit train's loop does not take: use it in "
                          "your own loop (dk.step() after a closure-driven optimizer.step(closure)) or "
                          "distkit.compat.perceptrain's optimize_step")
    try:
        with _without_dynamo():
            return cls(params, lr=lr, **kwargs)
    except TypeError as e:  # a keyword the class does not take
        raise ConfigError(f"optimizer = {cfg.optimizer!r}: {cls.__name__} rejected its arguments ({e}): "
                          f"check the keys against torch.optim.{cls.__name__}") from None


#: 2-D parameters whose name matches one of these (``re.search``) go to AdamW with the vectors: the embeddings and
#: the output head, as Keller Jordan's Muon, Moonshot's Moonlight and MuLoCo do (Muon is for hidden matrices).
#: ``optimizer = {"class": "muon", "adamw_names": [...]}`` replaces the list (``[]``: every 2-D parameter is Muon's).
MUON_ADAMW_NAMES = (r"embed", r"(^|\.)(wte|wpe|tok|pos|head|lm_head|classifier|score)(\.|$)")
#: distkit's default ``adjust_lr_fn`` for torch.optim.Muon (torch's own is "original"): Moonshot's RMS matching
#: (update scaled by 0.2 * sqrt(max(rows, cols))), under which one learning_rate and weight_decay serve both parts
MUON_ADJUST_LR = "match_rms_adamw"
#: the keys of ``optimizer = {"class": "muon", ...}`` that are not torch.optim.Muon's
MUON_OWN_KEYS = ("class", "adamw", "adamw_names")


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over the whole model: ``torch.optim.Muon`` steps the groups with ``use_muon=True`` (2-D
    matrices only), ``torch.optim.AdamW`` the groups with ``use_muon=False`` (everything else).

    It is a plain :class:`torch.optim.Optimizer` to everything around it: ``param_groups`` (each with its own
    class's hyperparameters; an LR scheduler scales every group's ``lr``), ``state`` (Muon's ``momentum_buffer``,
    AdamW's ``step``/``exp_avg``/``exp_avg_sq``, one dict), ``state_dict``/``load_state_dict`` (torch's own, so a
    checkpoint resumes bit for bit and the portable format keys it by parameter name), ``zero_grad``. The two
    inner optimizers hold no state of their own: before each step they are pointed at this object's groups (by
    flag) and state, so a ``load_state_dict``, Horovod's ``DistributedOptimizer`` (a subclass built from
    ``param_groups`` alone) or FSDP's re-pointing of the groups never leaves them stale.

    Cross-rank contract: Muon orthogonalises each matrix whole. On DDP, mpi and Horovod every rank holds whole
    matrices and the same reduced gradients, and each rank steps alone. On FSDP2 (DTensor shards) the step is
    collective: each matrix's update is all-gathered, orthogonalised whole on every rank and sliced back
    (:meth:`_step_whole_matrices`). DeepSpeed ZeRO 1-3 and its bf16/fp16 optimizers hand the optimizer flat 1-D
    partitions: refused before start (:attr:`needs_whole_matrices`).
    """

    #: read by the engines that shard parameters or flatten them (they refuse it, naming the fix)
    needs_whole_matrices = True

    def __init__(self, params: Iterable[dict[str, Any]]) -> None:
        self._parts: dict[bool, torch.optim.Optimizer] = {}
        super().__init__(params, {})
        for flag in (True, False):
            self._part(flag)  # builds and checks each part now (torch.optim.Muon: 2-D parameters only)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, for a group that says which part steps it: ``use_muon`` True (Muon) or False (AdamW)."""
        if not isinstance(param_group.get("use_muon"), bool):
            raise ValueError("MuonWithAdamW: each parameter group needs 'use_muon': True (torch.optim.Muon, 2-D "
                             "parameters) or False (torch.optim.AdamW)")
        super().add_param_group(param_group)

    def _part(self, use_muon: bool) -> Optional[torch.optim.Optimizer]:
        """The inner optimizer of the groups flagged ``use_muon``, pointed at them and at this object's state."""
        groups = [g for g in self.param_groups if g["use_muon"] is use_muon]
        if not groups:
            return None
        part = self._parts.get(use_muon)
        if part is None:  # torch's constructor checks the groups and fills in its defaults (the same dicts)
            part = self._parts[use_muon] = (torch.optim.Muon if use_muon else torch.optim.AdamW)(groups)
        part.param_groups, part.state = groups, self.state
        return part

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One step of each part: Muon on the matrices, then AdamW on the rest (disjoint parameters)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for use_muon in (True, False):
            part = self._part(use_muon)
            if part is not None and use_muon and _sharded(part):
                self._step_whole_matrices(part)
            elif part is not None:
                part.step()
        return loss

    def _step_whole_matrices(self, part: torch.optim.Optimizer) -> None:
        """Collective (every rank of the mesh, the same parameters in the same order). torch.optim.Muon's step,
        its arithmetic in its order, for sharded (FSDP2 DTensor) parameters: the momentum stays sharded (it is
        elementwise); the update is all-gathered whole, orthogonalised whole on every rank (the same matrix, so the
        same result, as DDP), and each rank keeps its own shard of it (sliced here, no communication)."""
        from torch.distributed.tensor import DTensor, distribute_tensor
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        for group in part.param_groups:
            lr, decay, momentum = float(group["lr"]), group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                whole = update.full_tensor() if isinstance(update, DTensor) else update
                ortho = _zeropower_via_newtonschulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
                if isinstance(p, DTensor):
                    ortho = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None)
                p.mul_(1 - lr * decay)
                p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))


def _sharded(part: torch.optim.Optimizer) -> bool:
    """Whether ``part`` steps DTensor parameters (FSDP2's shards). No DTensor exists before its module is imported."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and any(isinstance(p, dtensor.DTensor) for g in part.param_groups for p in g["params"])


def split_for_muon(params: Iterable[torch.Tensor], names: dict[int, str],
                   adamw_names: Iterable[str] = MUON_ADAMW_NAMES) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``params`` as (Muon's, AdamW's), each in the given order: Muon gets the 2-D parameters whose name (``names``
    by ``id``; "" where unknown) matches none of the regular expressions ``adamw_names``."""
    patterns = [re.compile(p) for p in adamw_names]
    muon: list[torch.Tensor] = []
    adamw: list[torch.Tensor] = []
    for p in params:
        name = names.get(id(p), "")
        (muon if p.ndim == 2 and not any(rx.search(name) for rx in patterns) else adamw).append(p)
    return muon, adamw


def build_muon(spec: dict[str, Any], params: Any, lr: float, lr_scale: float = 1.0,
               named_parameters: Optional[NamedParameters] = None) -> MuonWithAdamW:
    """``optimizer = {"class": "muon", **Muon's keys, "adamw": {**AdamW's keys}, "adamw_names": [regex, ...]}`` as
    one :class:`MuonWithAdamW`. ``lr`` (learning_rate, already times ``lr_scale`` = the world size under
    distributed.scale_lr) is Muon's; AdamW's ``lr`` and ``weight_decay`` default to Muon's (Moonshot's shared
    setting, with adjust_lr_fn "match_rms_adamw", distkit's default); an ``adamw.lr`` is scaled by ``lr_scale``
    too. ConfigError (one line, the fix) for a key or value torch's classes reject."""
    adamw_spec = spec.get("adamw", {})
    if not isinstance(adamw_spec, dict):
        raise ConfigError(f"optimizer 'muon': 'adamw' must be a dict of torch.optim.AdamW's keywords for the non-matrix "
                          f"parameters, e.g. {{'lr': 3e-4, 'betas': (0.9, 0.95)}}, got {adamw_spec!r}")
    adamw_names = spec.get("adamw_names", MUON_ADAMW_NAMES)
    if isinstance(adamw_names, str) or not all(isinstance(n, str) for n in adamw_names):
        raise ConfigError(f"optimizer 'muon': 'adamw_names' must be a list of regular expressions (parameter names "
                          f"that go to AdamW although 2-D, e.g. ['embed', 'lm_head']), got {adamw_names!r}")
    for pattern in adamw_names:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"optimizer 'muon': 'adamw_names' entry {pattern!r} is not a regular expression ({e}): "
                              "fix it or escape it with re.escape") from None
    listed = list(params)
    if any(isinstance(p, dict) for p in listed):
        raise ConfigError("optimizer 'muon' makes its own parameter groups (the matrices for Muon, the rest for "
                          "AdamW): give it the model's parameters, or build MuonWithAdamW with your own groups")
    names = {id(p): n for n, p in named_parameters()} if named_parameters is not None else {}
    muon_params, adamw_params = split_for_muon(listed, names, adamw_names)
    if "lr" in spec:
        raise ConfigError("optimizer 'muon': its learning rate is the 'learning_rate' key: remove 'lr' from the optimizer "
                          "dict (AdamW's part takes 'adamw': {'lr': ...})")
    muon_kwargs = {"adjust_lr_fn": MUON_ADJUST_LR, **{k: v for k, v in spec.items() if k not in MUON_OWN_KEYS}, "lr": lr}
    muon_decay = inspect.signature(torch.optim.Muon.__init__).parameters["weight_decay"].default
    adamw_kwargs = {"lr": lr, "weight_decay": muon_kwargs.get("weight_decay", muon_decay), **adamw_spec}
    if isinstance(adamw_spec.get("lr"), (int, float)) and not isinstance(adamw_spec["lr"], bool):
        adamw_kwargs["lr"] = adamw_spec["lr"] * lr_scale
    groups: list[dict[str, Any]] = []
    for use_muon, cls, chosen, kwargs in ((True, torch.optim.Muon, muon_params, muon_kwargs),
                                          (False, torch.optim.AdamW, adamw_params, adamw_kwargs)):
        probe = chosen or [torch.nn.Parameter(torch.zeros(2, 2))]  # an empty part: its keys are checked all the same
        try:
            made = cls(probe, **kwargs)
        except (TypeError, ValueError) as e:
            where = "the optimizer dict's" if use_muon else "'adamw'"
            raise ConfigError(f"optimizer 'muon': torch.optim.{cls.__name__} rejected {where} keys ({e}): check them "
                              f"against torch.optim.{cls.__name__}") from None
        if chosen:
            groups += [{**g, "use_muon": use_muon} for g in made.param_groups]
    if not groups:
        raise ConfigError("optimizer 'muon': the model has no parameters to optimise")
    return MuonWithAdamW(groups)


def call_optimizer_factory(factory: Callable[..., Any], params: Any,
                           named_parameters: Optional[NamedParameters] = None) -> Any:
    """Call an ``optimizer`` factory the way its signature asks.

    A factory with a parameter called ``named_parameters`` gets the model's ``(name, parameter)`` pairs there,
    as a list (so it may be walked more than once, as Hugging Face's decay / no-decay grouping does), by
    keyword: ``def optimizer(named_parameters)`` gets only the pairs; when ``named_parameters`` is not its first
    parameter (``def optimizer(params, named_parameters)``) the first one gets the parameters as well. Any
    other factory is the original form, ``params -> Optimizer``, called with the parameters alone (a name in
    the signature, not ``**kwargs``, asks: an old factory that takes ``**kwargs`` keeps being called as before).
    """
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: only the original form can be meant
        return factory(params)
    asked = sig.parameters.get("named_parameters")
    if asked is None or asked.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
        return factory(params)
    if named_parameters is None:
        raise ConfigError("the 'optimizer' factory takes named_parameters, which this caller cannot give: write it "
                          "as a factory params -> Optimizer")
    pairs = list(named_parameters())
    if next(iter(sig.parameters)) == "named_parameters":
        return factory(named_parameters=pairs)
    return factory(params, named_parameters=pairs)


def _warmup_then(warmup: int, total: int, decay: Callable[[float], float]) -> Callable[[int], float]:
    """LR multiplier per optimizer step ``s`` (0-based, the value used by step s+1): linear warm-up from
    1/warmup to 1 over ``warmup`` steps, then ``decay(progress)`` with progress in [0, 1] over the rest."""
    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return decay(min(1.0, (s - warmup) / max(1, total - warmup)))
    return factor


def build_scheduler(cfg: RunConfig, total_steps: int) -> Optional[Callable[[torch.optim.Optimizer], Any]]:
    """A factory ``optimizer -> LR scheduler`` for ``lr_scheduler``, or None. Stepped once per optimizer step.

    ``{"class": "constant" | "linear" | "cosine" | "step", "warmup_steps": N, ...}``: linear warm-up over N
    steps, then constant, linear to ``min_lr_ratio`` (default 0), half-cosine to ``min_lr_ratio``, or
    ``gamma`` (default 0.1) every ``step_size`` steps. Any other class names a ``torch.optim.lr_scheduler``
    class, built with the remaining keys (after a LinearLR warm-up when warmup_steps > 0). A callable is a
    factory ``(optimizer, total_steps) -> scheduler``. The same factory serves every engine (DeepSpeed calls
    it with its own optimizer), so the schedule is the same everywhere.
    """
    spec = cfg.lr_scheduler
    if spec is None:
        return None
    if callable(spec):
        return lambda opt: spec(opt, total_steps)
    kwargs = {k: v for k, v in spec.items() if k not in ("class", "warmup_steps")}
    name, warmup = spec["class"], int(spec.get("warmup_steps", 0))
    if isinstance(name, str) and name.lower() in SCHEDULES:
        floor = float(kwargs.pop("min_lr_ratio", 0.0))
        decay: Callable[[float], float]
        if name.lower() == "constant":
            decay = lambda p: 1.0  # noqa: E731
        elif name.lower() == "linear":
            decay = lambda p: floor + (1.0 - floor) * (1.0 - p)  # noqa: E731
        elif name.lower() == "cosine":
            decay = lambda p: floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))  # noqa: E731
        else:
            size, gamma = int(kwargs.pop("step_size", max(1, total_steps // 3))), float(kwargs.pop("gamma", 0.1))
            rest = max(1, total_steps - warmup)
            decay = lambda p: gamma ** (int(round(p * rest)) // size)  # noqa: E731
        if kwargs:
            raise ConfigError(f"lr_scheduler {name!r} does not take {sorted(kwargs)}: it takes warmup_steps"
                              f"{', min_lr_ratio' if name.lower() in ('linear', 'cosine') else ''}"
                              f"{', step_size, gamma' if name.lower() == 'step' else ''}")
        factor = _warmup_then(warmup, total_steps, decay)
        return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor)
    cls = scheduler_class(name)

    def make(opt: torch.optim.Optimizer) -> Any:
        try:
            main = cls(opt, **kwargs)
            if warmup <= 0:
                return main
            ramp = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0 / warmup, total_iters=warmup)
            return torch.optim.lr_scheduler.SequentialLR(opt, [ramp, main], milestones=[warmup])
        except TypeError as e:
            raise ConfigError(f"lr_scheduler = {spec!r}: {cls.__name__} rejected its arguments ({e}): check the keys "
                              f"against torch.optim.lr_scheduler.{cls.__name__}") from None
    return make


def scheduler_class(name: Any) -> type:
    """The ``torch.optim.lr_scheduler`` class ``name`` names (exact or case-insensitive)."""
    sched = torch.optim.lr_scheduler
    classes = _torch_classes(sched, sched.LRScheduler, ("LRScheduler", "_LRScheduler"))
    found = classes.get(str(name).lower())
    if found is None:
        raise ConfigError(f"unknown lr_scheduler class {name!r}: use one of {', '.join(SCHEDULES)} or a "
                          f"torch.optim.lr_scheduler class ({', '.join(sorted(c.__name__ for c in set(classes.values())))}), "
                          "or a factory (optimizer, total_steps) -> scheduler")
    return found  # type: ignore[no-any-return]


@contextlib.contextmanager
def _without_dynamo() -> Iterator[None]:
    """While an optimizer is constructed (the launching process's throw-away check, a rank's real one):
    ``Optimizer.add_param_group`` runs unwrapped. torch wraps it in ``torch._disable_dynamo``, whose first
    call imports ``torch._dynamo``: 1.3 s on a 2-core machine, spent by the process that launches the
    ranks on a check that never compiles anything (and by mpi/Horovod ranks; DDP imports it anyway). The
    wrapper calls ``fn.__dynamo_disable`` when set; it is set to ``fn`` itself here and removed afterwards.
    Nested uses leave it to the outermost."""
    fn = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", None)
    if fn is None or "__dynamo_disable" in vars(fn) or "torch._dynamo" in sys.modules:
        yield
        return
    setattr(fn, "__dynamo_disable", fn)
    try:
        yield
    finally:
        delattr(fn, "__dynamo_disable")


def check_components(cfg: RunConfig) -> None:
    """Up-front check (before any rank starts) of the keys whose names only torch knows: the optimizer
    class and its arguments, the scheduler and its arguments (built once on a throw-away parameter),
    and ``precision`` against the device. ConfigError (exit status 2) naming the key and the fix."""
    with _without_dynamo():
        _check_components(cfg)


def _check_components(cfg: RunConfig) -> None:
    probe = [torch.nn.Parameter(torch.zeros(1))]
    if not callable(cfg.optimizer):
        build_optimizer(cfg, probe)
    if cfg.lr_scheduler is not None and not callable(cfg.lr_scheduler):
        factory = build_scheduler(cfg, 10)
        assert factory is not None
        sched = factory(torch.optim.SGD(probe, lr=1.0))
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ConfigError("lr_scheduler 'ReduceLROnPlateau' steps on a metric, not once per optimizer step: use "
                              "a step-based schedule, or step it yourself from a callback's on_eval_end")
    if cfg.precision == "16-mixed" and (cfg.device == "cpu" or not torch.cuda.is_available()):
        raise ConfigError("precision '16-mixed' (float16 with loss scaling) needs a CUDA device; on the CPU use "
                          "precision = 'bf16-mixed'")
    check_device(cfg)


def check_device(cfg: RunConfig) -> None:
    """Before any rank starts: the process-group backend can work on the device the ranks will use.
    ``pg_backend 'nccl'`` only moves CUDA tensors; without a CUDA device every rank would fail in
    ``init_process_group`` or its first collective, each with a traceback. ConfigError (exit status 2)."""
    if cfg.distributed.pg_backend != "nccl":
        return
    if cfg.device == "cpu":
        raise ConfigError("distributed.pg_backend 'nccl' needs CUDA tensors but device is 'cpu': use pg_backend "
                          "'gloo', or leave pg_backend unset (nccl on CUDA, gloo on the CPU)")
    if not torch.cuda.is_available():
        raise ConfigError("distributed.pg_backend 'nccl' needs a CUDA device but none is visible: use pg_backend "
                          "'gloo', or leave pg_backend unset (nccl on CUDA, gloo on the CPU)")


def ranks_per_gpu_problem(device: str, ranks_here: int, visible: int) -> Optional[str]:
    """The one line that says why ``ranks_here`` ranks on one host cannot each take a GPU of their own (``visible``
    CUDA devices there) under ``device`` ("cuda", or "auto" with a GPU visible), or None when they can. Each rank
    takes ``cuda:LOCAL_RANK``; two ranks on one GPU is no setting NCCL accepts, and a local rank past the last GPU
    failed in ``torch.cuda.set_device`` with "invalid device ordinal" (a traceback, the other ranks waiting)."""
    if device == "cpu" or (device == "auto" and visible == 0) or ranks_here <= visible:
        return None
    if visible == 0:
        return NO_CUDA
    return (f"{ranks_here} ranks on this host but {visible} visible CUDA device{'s' * (visible > 1)} (device "
            f"{device!r}: one GPU per rank): start {visible} rank{'s' * (visible > 1)} per host (--nprocs {visible}, "
            f"torchrun --nproc_per_node {visible}), or set ++device cpu")


def pick_device(name: str, local_rank: int, local_world_size: int = 1) -> torch.device:
    """``cuda:local_rank`` for "cuda" (or "auto" with CUDA visible), else the CPU. ConfigError (exit status 2),
    before any collective, when this host's ``local_world_size`` ranks outnumber its GPUs
    (:func:`ranks_per_gpu_problem`): every rank of the host raises it, so none waits for another."""
    visible = torch.cuda.device_count() if name != "cpu" else 0
    problem = ranks_per_gpu_problem(name, max(local_world_size, local_rank + 1), visible)
    if problem is not None:
        raise ConfigError(problem)
    if name == "cuda" or (name == "auto" and visible > 0):
        torch.cuda.set_device(local_rank)  # before any collective: DDP/NCCL use the current device
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


#: when :meth:`distkit.Session.step` steps the LR scheduler given to ``dk.setup``: "step" (at every optimizer step,
#: what distkit did always) or "epoch" (never: the script steps it at the end of its epochs, as before; Lightning's
#: ``interval``)
SCHEDULER_INTERVALS = ("step", "epoch")


def scheduler_and_interval(lr_scheduler: Any, interval: str) -> tuple[Any, str]:
    """``dk.setup``'s scheduler argument and its ``interval``: a scheduler (or factory) with ``interval``, or
    Lightning's ``{"scheduler": s, "interval": "epoch"}`` (its interval wins). UsageError naming the fix for an
    unknown interval or dict key."""
    if isinstance(lr_scheduler, dict):
        unknown = sorted(set(lr_scheduler) - {"scheduler", "interval"})
        if "scheduler" not in lr_scheduler or unknown:
            raise UsageError("dk.setup(model, optimizer, lr_scheduler): a dict must be {'scheduler': s, 'interval': "
                             f"'step' or 'epoch'}} (Lightning's form), got the keys {sorted(lr_scheduler)}")
        lr_scheduler, interval = lr_scheduler["scheduler"], lr_scheduler.get("interval", interval)
    if interval not in SCHEDULER_INTERVALS:
        raise UsageError(f"dk.setup(..., interval={interval!r}): use 'step' (distkit steps the scheduler at every "
                         "optimizer step) or 'epoch' (your script steps it at the end of each epoch)")
    return lr_scheduler, interval


def check_stepped_scheduler(scheduler: Any) -> None:
    """A scheduler distkit steps at every optimizer step (interval "step") must step without arguments:
    ``ReduceLROnPlateau`` steps on a metric. UsageError naming the fix."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise UsageError("dk.setup: ReduceLROnPlateau steps on a metric, which distkit cannot pass at every optimizer "
                         "step: give it with interval='epoch' (dk.setup(model, optimizer, scheduler, interval='epoch')) "
                         "and keep your scheduler.step(val_loss) after each evaluation")

class ScaledOptimizer:
    """The optimizer as the engine sees it under fp16 loss scaling: ``step()`` goes through the GradScaler
    (skipped when a gradient overflowed), everything else is the optimizer's own."""

    def __init__(self, optimizer: Any, scaler: torch.amp.GradScaler) -> None:
        self._optimizer, self._scaler = optimizer, scaler

    def step(self, closure: Any = None) -> Any:
        return self._scaler.step(self._optimizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)
