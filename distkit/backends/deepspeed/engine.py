"""The DeepSpeed engine strategy: ``deepspeed.initialize`` / ``DeepSpeedEngine`` driven by distkit's loop.

grad mode: the DeepSpeed engine does everything it normally does: ``engine.backward``,
``engine.step``, engine-managed gradient accumulation, ZeRO partitioning, clipping,
bf16/fp16, its optimizer/scheduler blocks. distkit only drives the loop. param mode:
:mod:`.groups`; config checks: :mod:`.config`; state and checkpoints: :mod:`.state`.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from distkit.launch import lazy_import
from distkit.config import DistributedConfig, RunConfig
from distkit.sync.averager import flat_mean
from distkit.sync.compression import codec_of
from distkit.errors import CollectiveTimeout, ConfigError, OutputError, UnsupportedCombination, UsageError
from distkit.sync.replicas import ReplicaGroups

from .. import startup
from ..parts import bare_module, persistent_buffers, same_parameters_on_every_rank, unused_parameters
from ..buffers import DDPBufferRule
from .config import RESOLVED_NAME, _explicit, muon_refusal, zero_section
from .groups import _ReplicaGroups
from .state import _DeepSpeedState, _ViewAverager


@contextlib.contextmanager
def _without_shm_op() -> Iterator[None]:
    """Start DeepSpeed's communication backend without its CPU shared-memory all-reduce op.

    On the CPU accelerator ``deepspeed.comm.torch.TorchBackend.__init__`` JIT-builds and loads
    ``deepspeed_shm_comm_op`` (C++, ninja). Only ``inference_all_reduce`` (AutoTP inference) uses it,
    and without it that falls back to the process group's ``all_reduce``; training never calls it.
    The build costs 40-90 s on this 2-core machine the first time per virtual environment (torch's
    extension cache is keyed by the build's include paths, so every new venv builds again) and loading
    it 0.2 s per rank per run after that; it also maps a shared-memory segment per run. Restored on
    exit, so a user's own later ``TorchBackend`` is untouched.
    """
    try:
        # importlib, not "import deepspeed.comm.torch as m": that binds the attribute "torch" of the
        # package deepspeed.comm, which is the torch module (deepspeed/comm imports torch)
        ds_torch = importlib.import_module("deepspeed.comm.torch")
    except ImportError:  # another DeepSpeed layout: leave it as it is
        yield
        return
    original = getattr(ds_torch, "build_shm_op", None)
    if original is None:
        yield
        return
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = original


class _CollectiveForward:
    """A module's ``forward`` under ZeRO-3 whose collective timeout names the rule it broke.

    ZeRO-3 all-gathers each layer's parameters inside the forward pass, so a forward that only some ranks
    run (evaluation under ``if dk.is_main``) waits for the others until ``distributed.timeout_s`` and gloo
    then reports a bare "Timed out waiting ...ms for send operation". Such a timeout is re-raised as
    :class:`CollectiveTimeout` saying so and naming the fix; any other error passes unchanged.

    Set as the module's instance attribute ``forward`` (``nn.Module.__call__`` calls ``self.forward``).
    A class rather than a closure so that ``copy.deepcopy`` of the module (an EMA copy) calls the copy's
    own forward and pickling still works; ``__wrapped__`` keeps ``inspect.signature(module.forward)`` the
    model's own (Hugging Face inspects it).
    """

    def __init__(self, module: nn.Module, distributed: DistributedConfig) -> None:
        self.module, self.distributed = module, distributed  # (its timeouts, for the line)
        # a forward set on the instance before (another library's wrapper) is kept and called
        self.inner: Optional[Callable[..., Any]] = module.__dict__.get("forward")
        functools.update_wrapper(self, self.inner or type(module).forward.__get__(module))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            if self.inner is not None:
                return self.inner(*args, **kwargs)
            return type(self.module).forward(self.module, *args, **kwargs)
        except RuntimeError as e:  # gloo's and NCCL's errors (torch's DistBackendError is a RuntimeError)
            text = str(e).lower()
            if "timed out" not in text and "timeout" not in text:
                raise
            raise CollectiveTimeout(
                f"a forward pass timed out after {startup.bound_text(self.distributed)}: under ZeRO-3 the forward "
                "pass is collective (it gathers the parameters from every rank), so a forward that not every rank runs "
                "(evaluation under 'if dk.is_main') waits for the others forever; run the evaluation forward passes on "
                "every rank, the same number on each (dk.forward_is_collective says when), or use ZeRO stage 0-2") from e


class DeepSpeedStrategy(_DeepSpeedState):
    """deepspeed.initialize / DeepSpeedEngine, on torch.distributed (gloo on CPU, nccl on CUDA)."""

    name = "deepspeed"
    steps_scheduler = True
    handles_precision = True  # precision selects the config's bf16/fp16 block (check_config)
    fixed_accumulation = True  # the engine finds its accumulation boundary by counting micro-steps

    @property
    def grads_in_params(self) -> bool:
        """ZeRO 1-3 move the reduced gradients into the optimizer's partitions (``param.grad`` is then None
        or local); only stage 0 leaves them in ``param.grad``."""
        return getattr(self, "zero_stage", 0) == 0

    @classmethod
    def before_forks(cls, cfg: RunConfig) -> tuple[str, ...]:
        """DeepSpeed (0.3 s of CPU per rank here) and the Muon optimizer's module, which ZeRO-1/2's first gradient
        reduction and ZeRO-3's start import (its ``torch.compile`` decorators import torch's inductor: 1.0 s per
        rank). Only on the CPU (DeepSpeed picks its accelerator at import: the launching process must pick the one
        the ranks would); the Muon module is passed over in a DeepSpeed without it."""
        if cfg.device == "cuda" or (cfg.device != "cpu" and torch.cuda.device_count() > 0):  # (pick_device's rule;
            return ()  # device_count does not initialise CUDA)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # what init sets in each rank, before deepspeed is imported
        lazy_import.defer("mlflow")  # (see init)
        return ("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer")

    # -- lifecycle ----------------------------------------------------------------------------
    def init(self) -> None:
        self.check_config(self.cfg)
        self._resolve_batch()
        ds = self.cfg.distributed.deepspeed_config or {}
        self.zero_stage = int(zero_section(ds).get("stage", 0))
        if self.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere
        lazy_import.defer("mlflow")  # imported by DeepSpeed's autotuner, used by it only when autotuning
        import deepspeed  # type: ignore[import-untyped]

        super().init()  # torch.distributed with distkit's timeout; DeepSpeed wraps the existing group
        # DeepSpeed reads LOCAL_RANK from the environment; one plain process (no launcher) sets none
        os.environ.setdefault("LOCAL_RANK", str(self.env.local_rank))
        with _without_shm_op():
            deepspeed.init_distributed(dist_backend=self.pg_backend, verbose=False)
        self.mpu: _ReplicaGroups | None = None
        if self.reduce_type == "param":
            self.mpu = _ReplicaGroups(self.rank, self.world_size, self.cfg.distributed.param_sync_group_size)
        self.engine: Any = None

    def teardown(self) -> None:
        try:
            from deepspeed.utils import groups  # type: ignore[import-untyped]

            groups.mpu = None
        except ImportError:
            pass
        super().teardown()

    def backend_impl(self) -> str:
        import deepspeed  # type: ignore[import-untyped]

        return (f"deepspeed {deepspeed.__version__} ZeRO-{self.zero_stage} "
                f"(torch {torch.__version__}, {getattr(self, 'pg_backend', 'gloo')})")

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer,
              lr_scheduler: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
        import deepspeed  # type: ignore[import-untyped]

        cfg = self.cfg
        model.to(self.device)
        if self.zero_stage == 3 and bare_module(model) is not model:
            raise UsageError("ZeRO-3 cannot train a torch.compile'd module (it replaces the module's parameters with "
                             "partitioned ones): pass the uncompiled model to dk.setup, or use ZeRO stage 0-2")
        client = not self.engine_defines_optimizer()
        if client and optimizer is None:
            raise ConfigError("no optimizer: pass one to dk.setup(model, optimizer) or add an 'optimizer' block to "
                              "the DeepSpeed config")
        if not client and optimizer is not None:
            raise ConfigError("the DeepSpeed config's 'optimizer' block and the optimizer passed to dk.setup both "
                              "choose the optimizer: pass None to dk.setup or remove the block")
        if client and getattr(optimizer, "needs_whole_matrices", False) and (self.zero_stage or cfg.precision != "32"):
            raise UnsupportedCombination(muon_refusal(self.zero_stage, cfg.precision))  # (Muon: distkit.components)
        # payload per step in grad mode: one gradient reduction (all-reduce or reduce-scatter) of every parameter
        self._grad_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
        startup_elements = sum(p.numel() for p in model.parameters())
        conf = self.resolved_deepspeed_config(client)
        # atomically, by rank 0: a full disk leaves the previous file whole and stops every rank with rank 0's
        # one line (agreed), instead of rank 0 failing while the others wait for it in DeepSpeed's start-up
        from distkit.checkpoint import write_json

        failed: Optional[OutputError] = None
        # an own loop that chose no output_dir gets no file in the working directory's runs/default/
        if self.is_main and (cfg.writes_outputs or _explicit(cfg, "output_dir")):
            try:
                write_json(os.path.join(cfg.output_dir, RESOLVED_NAME), conf)
            except OutputError as e:
                failed = e
        failed = self.broadcast_object(failed, 0)
        if failed is not None:
            failed.agreed = True
            raise failed
        if self.mpu is not None:  # groups would each broadcast from their own first rank: use rank 0's state
            self.broadcast_tensors(list(model.parameters()) + list(model.buffers()))
        kwargs: dict[str, Any] = {"model": model, "config": conf, "mpu": self.mpu, "lr_scheduler": lr_scheduler}
        if client:
            kwargs["optimizer"] = optimizer
        else:
            kwargs["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
        engine, ds_opt, _, self.lr_scheduler = deepspeed.initialize(**kwargs)
        self.engine = engine
        if self.zero_stage == 3:  # a one-rank forward (evaluation on rank 0 only) times out: say why
            # both: the engine's forward also covers the gather in the model's own pre-forward hook (it runs
            # before the model's forward); the model's covers a call of the bare model (dk.unwrap()(x))
            engine.module.forward = _CollectiveForward(engine.module, cfg.distributed)
            engine.forward = _CollectiveForward(engine, cfg.distributed)
        dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else None
        if self.mpu is None and self.world_size > 1:  # the engine broadcast rank 0's weights (in its dtype)
            self.comm_bytes += startup_elements * (4 if dtype is None else 2)
        if dtype is not None:  # the data loader yields fp32 features; the engine's weights are 16-bit
            engine.module.register_forward_pre_hook(
                lambda _m, args: tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a
                                       for a in args))
        self._hook_buffers(engine)
        if self.mpu is not None:
            masters, refresh = self._masters(engine)
            buffers = [(n, b) for n, b in self.unwrap(engine).named_buffers() if b.is_floating_point()]
            groups = self._zero_groups(engine)
            names = {id(p): n for n, p in self.unwrap(engine).named_parameters()}
            d = cfg.distributed
            sizes, flats = None, None
            if d.param_sync_fragments > 1 or codec_of(d) != "none":
                # per model parameter, in the model's order, the part of the master this rank holds (views into the
                # flat partitions): fragments are runs of whole parameters cut by their whole sizes, the same
                # parameters in each fragment as on every other engine; a codec's blocks (int4, int8, e3m0, top-k
                # chunks), which run over the concatenation, group the same values as on every other engine (the
                # flat partitions hold the parameters in optimizer-group order, with padding); and the error
                # feedback is saved per parameter, as every engine saves it
                flats = masters
                masters = self._master_views(engine)
                sizes = [getattr(p, "ds_numel", p.numel()) for p in self.unwrap(engine).parameters()] + \
                    [b.numel() for _, b in buffers]
            self.averager = _ViewAverager(flats, self, masters, buffers, refresh,
                                          None if groups is None else [(names[id(p)], p) for g in groups for p in g],
                                          sync_step=d.param_sync_step, sync_time_diff=d.param_sync_time_diff,
                                          outer_optimizer=d.outer_optimizer, fragments=d.param_sync_fragments,
                                          fragment_sizes=sizes, compression=codec_of(d),
                                          error_feedback=d.param_sync_error_feedback, overlap=d.param_sync_overlap)
        # which trainable parameters got a gradient since the last boundary (see backward)
        self._trainable = [(n, p) for n, p in self.unwrap(engine).named_parameters() if p.requires_grad]
        self._seen: set[int] = set()
        # where the script declared that parameters may go unused, check each backward that the ranks use the same
        self._check_graphs = self.reduce_type == "grad" and self.world_size > 1 and bool(
            self.cfg.distributed.options.get("find_unused_parameters", False))
        for _, p in self._trainable:
            p.register_post_accumulate_grad_hook(lambda q: self._seen.add(id(q)))
        return engine, ds_opt

    def engine_defines_optimizer(self) -> bool:
        return "optimizer" in (self.cfg.distributed.deepspeed_config or {})

    def _hook_buffers(self, engine: Any) -> None:
        """DDP's rule for buffers (BatchNorm statistics), which DeepSpeed has not (:mod:`distkit.backends.buffers`):
        before the forwards DDP syncs before, the leader's persistent buffers replace the others', where the ranks
        reduce gradients together (rank 0's in grad mode, the replica group's first rank's with replica groups;
        none where every rank is its own replica). Only model state: a constant (non-persistent) buffer such as a
        causal mask would cost a broadcast per step for nothing."""
        buffers = persistent_buffers(self.unwrap(engine))
        if self.mpu is None:
            group, src, size = None, 0, self.world_size
        else:
            group, src, size = self.mpu.dp_group, self.mpu.index * self.mpu.size, self.mpu.size
        if not buffers or size == 1:
            return

        def sync() -> None:
            for b in buffers:
                self.comm_bytes += b.numel() * b.element_size()
                dist.broadcast(b.data, src=src, group=group)

        DDPBufferRule(engine.module, sync, lambda: self.outside_no_sync)

    def _averaging_group(self) -> Any:
        return self.mpu.cross_group if self.mpu is not None else None

    def averaging_size(self) -> int:
        return self.mpu.cross_size if self.mpu is not None else self.world_size

    def _exchange_ranks(self) -> tuple[list[list[int]], int]:
        if self.mpu is None:
            return [list(range(self.world_size))], 0
        return ReplicaGroups(self.rank, self.world_size, self.mpu.size).crosses(), self.mpu.position

    def average_over(self, tensors: list[torch.Tensor], group: Any, size: int) -> None:
        """Collective over ``group`` (None = all ranks): set each tensor to its mean; one flat all-reduce."""
        if not tensors or size == 1:
            return

        def mean(flat: torch.Tensor) -> None:
            self.comm_bytes += flat.numel() * flat.element_size()
            dist.all_reduce(flat, group=group)
            flat.div_(size)

        flat_mean(tensors, mean, dtype=torch.float32)

    # -- per step -------------------------------------------------------------------------------
    def unwrap(self, model: nn.Module) -> nn.Module:
        return bare_module(getattr(model, "module", model))

    def forward_is_collective(self, model: nn.Module) -> bool:
        """ZeRO-3 all-gathers each layer's parameters inside the forward pass."""
        return self.zero_stage == 3

    def copies_refused(self, model: nn.Module) -> Optional[str]:
        if self.zero_stage != 3:
            return None
        return ("under ZeRO-3 the model's parameters are partitioned, so a copy made from it (AveragedModel, deepcopy) "
                "holds empty tensors: build the copy inside deepspeed.zero.GatheredParameters(model.parameters()), or "
                "use ZeRO stage 0-2")

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        # The engine manages accumulation itself (it knows the boundary from its micro-step counter).
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, model: nn.Module) -> None:
        engine: Any = model  # the DeepSpeedEngine setup() returned
        boundary = engine.is_gradient_accumulation_boundary()
        if self._check_graphs:  # before DeepSpeed's buckets reduce what differs (parts.same_parameters_on_every_rank)
            same_parameters_on_every_rank(self, loss, self._trainable, "DeepSpeed ZeRO")
        engine.backward(loss, scale_wrt_gas=False)  # distkit's loop already divided by the accumulation steps
        if not boundary:
            engine.step()  # a micro-step: only advances the engine's counter (no optimizer step)
            return
        unused = [n for n, p in self._trainable if id(p) not in self._seen]
        self._seen = set()
        if unused:
            # DeepSpeed reduces zeros for them, and weight decay or Adam's momentum then moves them, where DDP
            # leaves a parameter without gradient alone: stop before that step.
            raise unused_parameters(self.rank, unused, "DeepSpeed would still apply weight decay and momentum to them "
                                    "(DDP does not): freeze them (requires_grad_(False)) or use the ddp, mpi or "
                                    "horovod engine with find_unused_parameters")

    def clip_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """The engine clips inside ``engine.step`` to ``gradient_clipping`` of the resolved config; a
        different ``max_norm`` cannot be applied here. Returns NaN (the norm is the engine's)."""
        if self.cfg.gradient_clip is None or abs(float(max_norm) - self.cfg.gradient_clip) > 1e-12:
            raise UnsupportedCombination(
                f"under DeepSpeed the engine clips gradients inside step(): set gradient_clip = {max_norm:g} (or "
                f"'gradient_clipping' in the DeepSpeed config) instead of calling clip_grad_norm({max_norm:g})")
        return float("nan")

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        engine: Any = model
        engine.step()  # the optimizer step (this is the accumulation boundary) + zero_grad
        if self.reduce_type == "grad":
            self.comm_bytes += self._grad_bytes
        if self.averager is not None:
            self.averager.after_step()
