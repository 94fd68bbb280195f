"""DeepSpeed (ZeRO stages 0-3) as a distkit backend.

grad mode: the DeepSpeed engine does everything it normally does: ``engine.backward``,
``engine.step``, engine-managed gradient accumulation, ZeRO partitioning, clipping,
bf16/fp16, its optimizer/scheduler blocks. distkit only drives the loop.

param mode (DeepSpeed has none): the ranks are cut into replica groups of
``distributed.param_sync_group_size`` consecutive ranks. Each group is one DeepSpeed
data-parallel world (handed to DeepSpeed as a Megatron-style ``mpu``): inside it ZeRO
partitions and gradients are reduced as usual; the groups step independently, and every
``param_sync_step`` steps :class:`~distkit.averaging.ParamAverager` averages across
groups. What is averaged is the optimizer's fp32 *master* copy (ZeRO-1/2
``single_partition_of_fp32_groups``, ZeRO-3 ``fp32_partitioned_groups_flat``, the bf16
optimizer's ``fp32_groups_flat_partition``; the parameters themselves at stage 0 fp32),
over the ranks that hold the same partition in each group; the model's (bf16/fp16/fp32)
weights are then rewritten from it, so the next step starts from the average. Floating
buffers are averaged over all ranks. Optimizer moments stay local (as for DDP).

Config: the DeepSpeed JSON (``cfg.distributed.deepspeed_config``) is honoured; where a
DeepSpeed key and a distkit key overlap (batch size, accumulation, clipping, optimizer)
they must agree or :meth:`DeepSpeedStrategy.check_config` raises ConfigError naming
both. ``gradient_clip`` <-> ``gradient_clipping``: DeepSpeed's own default is 1.0, distkit's
is "no clipping"; distkit always writes the key, so a run clips only if one of the two
says so. The resolved JSON is written to ``output_dir/deepspeed_config.resolved.json``.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from distkit.averaging import ParamAverager
from distkit.config import RunConfig
from distkit.errors import (BackendUnavailable, CollectiveTimeout, ConfigError, OutputError, UnsupportedCombination,
                            UsageError)

from .ddp import DDPStrategy
from .base import bare_module, unused_parameters

#: file (under output_dir) holding the DeepSpeed config the engine really got
RESOLVED_NAME = "deepspeed_config.resolved.json"
#: where save_engine_files puts DeepSpeed's checkpoint inside a distkit checkpoint directory
ENGINE_DIR = "deepspeed"
TAG = "ds"

_DEFAULTS = RunConfig()


def _explicit(cfg: RunConfig, key: str) -> bool:
    """Did the user set top-level ``key``? Uses ``cfg.explicit_keys`` when the resolver
    records it, else "differs from the default" (a value equal to the default counts as unset)."""
    keys = cfg.explicit_keys
    if keys is not None:
        return key in keys
    return bool(getattr(cfg, key) != getattr(_DEFAULTS, key))


def _pos_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"DeepSpeed config '{name}' must be an integer >= 1, got {value!r}")
    return value


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


def zero_section(ds: dict[str, Any]) -> dict[str, Any]:
    z = ds.get("zero_optimization") or {}
    if not isinstance(z, dict):
        raise ConfigError(f"DeepSpeed config 'zero_optimization' must be an object, got {z!r}")
    return z


def _offload_device(z: dict[str, Any], key: str) -> str:
    section = z.get(key) or {}
    return str(section.get("device", "none")) if isinstance(section, dict) else "none"


def _enabled(ds: dict[str, Any], key: str) -> bool:
    section = ds.get(key) or {}
    return bool(section.get("enabled", False)) if isinstance(section, dict) else bool(section)


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

    def __init__(self, module: nn.Module, timeout_s: float) -> None:
        self.module, self.timeout_s = module, timeout_s
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
                f"a forward pass timed out after distributed.timeout_s = {self.timeout_s:g} s: under ZeRO-3 the forward "
                "pass is collective (it gathers the parameters from every rank), so a forward that not every rank runs "
                "(evaluation under 'if dk.is_main') waits for the others forever; run the evaluation forward passes on "
                "every rank, the same number on each (dk.forward_is_collective says when), or use ZeRO stage 0-2") from e


class _ReplicaGroups:
    """A Megatron-style ``mpu`` for DeepSpeed: data parallel = this rank's replica group of
    ``size`` consecutive ranks; no tensor/pipeline parallelism. Creating it is collective."""

    def __init__(self, rank: int, world_size: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.index = rank // size              # which replica group
        self.position = rank % size            # rank inside the group = ZeRO partition id
        groups = [dist.new_group(list(range(k * size, (k + 1) * size))) for k in range(world_size // size)]
        cross = [dist.new_group(list(range(i, world_size, size))) for i in range(size)]
        singles = [dist.new_group([r]) for r in range(world_size)]
        self.dp_group, self.cross_group, self.single = groups[self.index], cross[self.position], singles[rank]
        self.cross_size = world_size // size

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

    def __init__(self, strategy: DeepSpeedStrategy, masters: list[torch.Tensor], buffers: list[tuple[str, torch.Tensor]],
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

    def average_parameters(self, tensors: list[torch.Tensor]) -> None:
        s = self._ds
        assert s.mpu is not None
        s.average_over(tensors[:self._n_masters], s.mpu.cross_group, s.mpu.cross_size)
        s.average_over(tensors[self._n_masters:], None, s.world_size)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return self._ds.all_reduce(tensor, op)

    def sync(self) -> None:
        super().sync()
        self._refresh()


class DeepSpeedStrategy(DDPStrategy):
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

    def check_accumulation(self, steps: int) -> None:
        """An accumulation set after start-up must agree with the DeepSpeed config's own batch keys."""
        ds = self.cfg.distributed.deepspeed_config or {}
        given = ds.get("gradient_accumulation_steps")
        if given is not None and int(given) != steps:
            raise ConfigError(f"dk.set_accumulation({steps}) and the DeepSpeed config's 'gradient_accumulation_steps' "
                              f"= {given} disagree: remove the key from the config or make them equal")
        if "train_batch_size" in ds:
            tbs = self.cfg.batch_size * steps * self._data_parallel_size()
            if int(ds["train_batch_size"]) != tbs:
                raise ConfigError(f"dk.set_accumulation({steps}) makes train_batch_size {tbs}, but the DeepSpeed config "
                                  f"says {ds['train_batch_size']}: remove 'train_batch_size' from the config or make "
                                  "them agree")

    # -- before any process group ------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        """Fold DeepSpeed's keys into distkit's (ConfigError on disagreement) and refuse what cannot work.

        Idempotent; mutates ``cfg`` only to copy a DeepSpeed value into the matching distkit key.
        """
        super().check_config(cfg)
        if importlib.util.find_spec("deepspeed") is None:
            raise BackendUnavailable("backend 'deepspeed' needs DeepSpeed: pip install 'distkit[deepspeed]' "
                                     "(or pip install deepspeed==0.19.8)")
        d = cfg.distributed
        ds = d.deepspeed_config if d.deepspeed_config is not None else {}
        if not isinstance(ds, dict):
            raise ConfigError(f"'deepspeed_config' must be a dict or a JSON file path, got {ds!r}")
        known = getattr(cfg, "_deepspeed_known", None)
        if known is None:  # first call: remember which batch keys the user gave (for init's train_batch_size rule)
            known = {"micro": "train_micro_batch_size_per_gpu" in ds or _explicit(cfg, "batch_size"),
                     "gas": "gradient_accumulation_steps" in ds or _explicit(cfg, "accum_grad_multiple_step")}
            cfg.__dict__["_deepspeed_known"] = known
        pairs = (("train_micro_batch_size_per_gpu", "batch_size"),
                 ("gradient_accumulation_steps", "accum_grad_multiple_step"))
        for ds_key, key in pairs:
            if ds_key in ds:
                value = _pos_int(ds_key, ds[ds_key])
                if _explicit(cfg, key) and getattr(cfg, key) != value:
                    raise ConfigError(f"'{key}' = {getattr(cfg, key)} (distkit) and '{ds_key}' = {value} (DeepSpeed "
                                      f"config) disagree: remove one of them or make them equal")
                setattr(cfg, key, value)
        if "train_batch_size" in ds:
            _pos_int("train_batch_size", ds["train_batch_size"])
        if "gradient_clipping" in ds:
            clip = ds["gradient_clipping"]
            if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
                raise ConfigError(f"DeepSpeed config 'gradient_clipping' must be a number >= 0 (0 = off), got {clip!r}")
            clip_value = float(clip) if clip > 0 else None
            if _explicit(cfg, "gradient_clip") and cfg.gradient_clip != clip_value:
                raise ConfigError(f"'gradient_clip' = {cfg.gradient_clip} (distkit) and 'gradient_clipping' = {clip} "
                                  "(DeepSpeed config) disagree: remove one of them or make them equal")
            cfg.gradient_clip = clip_value
        if "optimizer" in ds:
            for key in ("optimizer", "learning_rate"):
                if _explicit(cfg, key):
                    raise ConfigError(f"'{key}' (distkit) and the 'optimizer' block of the DeepSpeed config both choose "
                                      f"the optimizer: remove '{key}' (DeepSpeed's block wins) or the 'optimizer' block "
                                      "(distkit's optimizer is then passed to DeepSpeed as a client optimizer)")
            if d.scale_lr:
                raise ConfigError("'distributed.scale_lr' cannot scale the learning rate of the DeepSpeed config's "
                                  "'optimizer' block: set its params.lr instead")
        z = zero_section(ds)
        stage = z.get("stage", 0)
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"DeepSpeed config zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
        for key in ("offload_optimizer", "offload_param"):
            dev = _offload_device(z, key)
            if dev not in ("none", "cpu", "nvme"):
                raise ConfigError(f"zero_optimization.{key}.device must be none, cpu or nvme, got {dev!r}")
        if _offload_device(z, "offload_param") != "none" and stage != 3:
            raise UnsupportedCombination(f"zero_optimization.offload_param needs ZeRO stage 3 (this config has stage "
                                         f"{stage}): set stage 3 or remove offload_param")
        if _offload_device(z, "offload_optimizer") != "none" and stage == 0:
            raise UnsupportedCombination("zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3: set a stage "
                                         "or remove offload_optimizer")
        if _enabled(ds, "fp16") and _enabled(ds, "bf16"):
            raise ConfigError("the DeepSpeed config enables both fp16 and bf16: keep one")
        # precision <-> the bf16/fp16 blocks: either may decide, they must not disagree
        block = "bf16-mixed" if _enabled(ds, "bf16") else "16-mixed" if _enabled(ds, "fp16") else "32"
        if not _explicit(cfg, "precision"):
            cfg.precision = block
        elif cfg.precision != block:
            wanted = {"bf16-mixed": "bf16", "16-mixed": "fp16"}.get(cfg.precision)
            if block != "32" or (wanted is not None and isinstance(ds.get(wanted), dict) and "enabled" in ds[wanted]):
                raise ConfigError(f"'precision' = {cfg.precision!r} (distkit) and the DeepSpeed config (which "
                                  f"{'enables ' + ('bf16' if block == 'bf16-mixed' else 'fp16') if block != '32' else 'disables ' + str(wanted)}) "
                                  "disagree: remove one of them or make them equal")
            ds[wanted] = {"enabled": True}  # precision selects the block DeepSpeed applies
        if "scheduler" in ds and cfg.lr_scheduler is not None:
            raise ConfigError("'lr_scheduler' (distkit) and the 'scheduler' block of the DeepSpeed config both choose "
                              "the LR schedule: remove one of them")
        if d.reduce_type == "param" and cfg.nprocs > 1 and cfg.nprocs % d.param_sync_group_size:
            raise UnsupportedCombination(f"param_sync_group_size {d.param_sync_group_size} does not divide the world "
                                         f"size {cfg.nprocs} (nprocs): use a divisor of the number of ranks")
        if d.reduce_type == "grad" and d.param_sync_group_size != 1:
            raise ConfigError("'distributed.param_sync_group_size' only applies to reduce_type 'param': remove it")
        if d.reduce_type == "param":
            if "nvme" in (_offload_device(z, "offload_optimizer"), _offload_device(z, "offload_param")):
                raise UnsupportedCombination("param mode averages the optimizer's master weights in memory; NVMe "
                                             "offload keeps them on disk: use offload device 'cpu' or reduce_type 'grad'")
            if _enabled(ds, "fp16") and stage == 0:
                raise UnsupportedCombination("param mode with fp16 needs a ZeRO stage >= 1 (stage 0 fp16 keeps its fp32 "
                                             "master copy where distkit cannot refresh the weights from it): "
                                             "use stage 1-3 or bf16")
            if ds.get("zero_optimization", {}).get("zero_hpz_partition_size", 1) not in (1, None):
                raise UnsupportedCombination("param mode does not support ZeRO++ hierarchical partitioning "
                                             "(zero_hpz_partition_size): remove it")

    def _data_parallel_size(self) -> int:
        return self.cfg.distributed.param_sync_group_size if self.reduce_type == "param" else self.world_size

    def _resolve_batch(self) -> None:
        """DeepSpeed's rule train_batch_size = micro * accumulation * data-parallel size, with this world size."""
        cfg, ds = self.cfg, self.cfg.distributed.deepspeed_config or {}
        g = self.cfg.distributed.param_sync_group_size
        if self.reduce_type == "param" and self.world_size % g:
            # every rank finds this before any collective: reported once (check_config finds it before start
            # where --nprocs gives the world size)
            error = UnsupportedCombination(f"param_sync_group_size {g} does not divide the world size "
                                           f"{self.world_size}: use a divisor of the number of ranks")
            error.agreed = True
            raise error
        dp, tbs = self._data_parallel_size(), ds.get("train_batch_size")
        if tbs is None:
            return
        known = getattr(cfg, "_deepspeed_known", {"micro": True, "gas": True})
        micro, gas = cfg.batch_size, cfg.accum_grad_multiple_step
        if known["micro"] and not known["gas"] and tbs % (micro * dp) == 0:
            gas = tbs // (micro * dp)
        elif not known["micro"] and tbs % (gas * dp) == 0:
            micro = tbs // (gas * dp)
        if micro * gas * dp != tbs:
            raise ConfigError(f"DeepSpeed config 'train_batch_size' = {tbs} != train_micro_batch_size_per_gpu "
                              f"(batch_size) {micro} x gradient_accumulation_steps {gas} x data-parallel size {dp}: "
                              "fix one of them (or drop train_batch_size)")
        cfg.batch_size, cfg.accum_grad_multiple_step = micro, gas

    def resolved_deepspeed_config(self, client_optimizer: bool) -> dict[str, Any]:
        """The dict handed to deepspeed.initialize (also written to output_dir)."""
        cfg = self.cfg
        conf = copy.deepcopy(cfg.distributed.deepspeed_config or {})
        conf["train_micro_batch_size_per_gpu"] = cfg.batch_size
        conf["gradient_accumulation_steps"] = cfg.accum_grad_multiple_step
        conf["train_batch_size"] = cfg.batch_size * cfg.accum_grad_multiple_step * self._data_parallel_size()
        conf["gradient_clipping"] = float(cfg.gradient_clip or 0.0)  # explicit: DeepSpeed's own default is 1.0
        if client_optimizer:
            conf.setdefault("zero_allow_untested_optimizer", True)
        if _offload_device(zero_section(conf), "offload_optimizer") != "none":
            conf.setdefault("zero_force_ds_cpu_optimizer", False)  # torch optimizers work; CPUAdam needs a compiler
        conf.setdefault("steps_per_print", 10 ** 9)  # distkit logs; DeepSpeed prints only if asked
        return conf

    # -- lifecycle ----------------------------------------------------------------------------
    def init(self) -> None:
        self.check_config(self.cfg)
        self._resolve_batch()
        ds = self.cfg.distributed.deepspeed_config or {}
        self.zero_stage = int(zero_section(ds).get("stage", 0))
        if self.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere
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
        # payload per step in grad mode: one gradient reduction (all-reduce or reduce-scatter) of every parameter
        self._grad_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
        startup_elements = sum(p.numel() for p in model.parameters())
        conf = self.resolved_deepspeed_config(client)
        # atomically, by rank 0: a full disk leaves the previous file whole and stops every rank with rank 0's
        # one line (agreed), instead of rank 0 failing while the others wait for it in DeepSpeed's start-up
        from distkit.checkpoint import write_json

        failed: Optional[OutputError] = None
        if self.is_main:
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
            engine.module.forward = _CollectiveForward(engine.module, cfg.distributed.timeout_s)
            engine.forward = _CollectiveForward(engine, cfg.distributed.timeout_s)
        dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else None
        if self.mpu is None and self.world_size > 1:  # the engine broadcast rank 0's weights (in its dtype)
            self.comm_bytes += startup_elements * (4 if dtype is None else 2)
        if dtype is not None:  # the data loader yields fp32 features; the engine's weights are 16-bit
            engine.module.register_forward_pre_hook(
                lambda _m, args: tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a
                                       for a in args))
        if self.mpu is not None:
            masters, refresh = self._masters(engine)
            buffers = [(n, b) for n, b in self.unwrap(engine).named_buffers() if b.is_floating_point()]
            groups = self._zero_groups(engine)
            names = {id(p): n for n, p in self.unwrap(engine).named_parameters()}
            d = cfg.distributed
            self.averager = _MasterAverager(self, masters, buffers, refresh,
                                            None if groups is None else [(names[id(p)], p) for g in groups for p in g],
                                            sync_step=d.param_sync_step, sync_time_diff=d.param_sync_time_diff,
                                            outer_optimizer=d.outer_optimizer)
        # which trainable parameters got a gradient since the last boundary (see backward)
        self._trainable = [(n, p) for n, p in self.unwrap(engine).named_parameters() if p.requires_grad]
        self._seen: set[int] = set()
        for _, p in self._trainable:
            p.register_post_accumulate_grad_hook(lambda q: self._seen.add(id(q)))
        return engine, ds_opt

    def engine_defines_optimizer(self) -> bool:
        return "optimizer" in (self.cfg.distributed.deepspeed_config or {})

    def _masters(self, engine: Any) -> tuple[list[torch.Tensor], Any]:
        """The optimizer's fp32 master tensors (this rank's partitions) and how to rewrite the weights from them."""
        opt = engine.optimizer
        if hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO-1/2
            return list(opt.single_partition_of_fp32_groups), opt.update_lp_params
        if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3
            def refresh() -> None:
                for i in range(len(opt.fp32_partitioned_groups_flat)):
                    opt._reassign_or_swap_out_partitioned_parameters(i)
            return list(opt.fp32_partitioned_groups_flat), refresh
        if hasattr(opt, "fp32_groups_flat_partition"):  # bf16 optimizer (stage 0 + bf16)
            return list(opt.fp32_groups_flat_partition), opt.update_lp_params
        params = list(engine.module.parameters())
        if any(p.dtype != torch.float32 for p in params):
            raise UnsupportedCombination(f"param mode cannot find the master weights of {type(opt).__name__}: "
                                         "use a ZeRO stage >= 1 or fp32")
        return params, lambda: None

    def average_over(self, tensors: list[torch.Tensor], group: Any, size: int) -> None:
        """Collective over ``group`` (None = all ranks): set each tensor to its mean; one flat all-reduce."""
        if not tensors or size == 1:
            return
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
            self.comm_bytes += flat.numel() * flat.element_size()
            dist.all_reduce(flat, group=group)
            flat.div_(size)
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n

    # -- per step -------------------------------------------------------------------------------
    def unwrap(self, model: nn.Module) -> nn.Module:
        return bare_module(getattr(model, "module", model))

    def forward_is_collective(self, model: nn.Module) -> bool:
        """ZeRO-3 all-gathers each layer's parameters inside the forward pass."""
        return self.zero_stage == 3

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        # The engine manages accumulation itself (it knows the boundary from its micro-step counter).
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, model: nn.Module) -> None:
        engine: Any = model  # the DeepSpeedEngine setup() returned
        boundary = engine.is_gradient_accumulation_boundary()
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

    # -- state ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _gathered(self, module: nn.Module) -> Iterator[None]:
        """Collective under ZeRO-3 (inside the replica group): whole parameters for the duration."""
        if self.zero_stage == 3:
            import deepspeed  # type: ignore[import-untyped]

            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                yield
        else:
            yield

    @contextlib.contextmanager
    def _gathered_one(self, param: nn.Parameter) -> Iterator[None]:
        """Collective under ZeRO-3: one whole parameter for the duration."""
        if hasattr(param, "ds_id"):
            import deepspeed  # type: ignore[import-untyped]

            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                yield
        else:
            yield

    def full_named_parameters(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        module = self.unwrap(model)
        with self._gathered(module):
            named = [(n, p.detach().clone()) for n, p in module.named_parameters()]
        yield from named

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Param mode only (the replica groups differ between syncs): this group's whole model in fp32
        (collective inside the group under ZeRO-3) for the rank file; the resumable state is the engine
        checkpoint written by :meth:`save_engine_files`. Grad mode writes no such copy."""
        module = self.unwrap(model)
        with self._gathered(module):
            sd = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).clone()
                  for k, v in module.state_dict().items()}
        return {"model": sd, "optimizer": None, "zero_stage": self.zero_stage}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Nothing: :meth:`load_engine_files` restored model, optimizer and scheduler."""

    def _zero_groups(self, engine: Any) -> Optional[list[list[nn.Parameter]]]:
        """The model parameters of each optimizer group when ZeRO (1-3) or the bf16 optimizer partitions
        the fp32 state (None: the optimizer holds the model's own parameters)."""
        opt = engine.optimizer
        for attr in ("bit16_groups", "fp16_groups"):  # ZeRO-1/2 and bf16; ZeRO-3
            groups = getattr(opt, attr, None)
            if groups and any(hasattr(p, "_hp_mapping") or hasattr(p, "ds_id") for g in groups for p in g):
                return [list(g) for g in groups]
        return None

    @staticmethod
    def _flat(opt: Any, g: int) -> tuple[torch.Tensor, dict[str, Any], dict[str, Any]]:
        """Partitioned group ``g``'s fp32 flat tensor (this rank's partition), its state in the inner
        optimizer and the inner param group holding its hyper-parameters. (ZeRO-3 detaches the flats
        from the inner optimizer's param groups between steps, so they are found by attribute.)"""
        inner = opt.optimizer
        if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3 (sub-groups)
            flat = opt.fp32_partitioned_groups_flat[g]
            group = inner.param_groups[opt.sub_group_to_group_id[g]]
        else:
            flat = (opt.single_partition_of_fp32_groups if hasattr(opt, "single_partition_of_fp32_groups")
                    else opt.fp32_groups_flat_partition)[g]
            group = inner.param_groups[g]
        return flat, inner.state.setdefault(flat, {}), group

    @staticmethod
    def _link_optimizer_state(opt: Any) -> None:
        """Point every parameter's fragment mapping (ZeRO-1/2, bf16) at the inner optimizer's current state.

        DeepSpeed links them only once, lazily, after the step of the *first* param group: ZeRO-1/2 step
        the groups one at a time, so a second group (AdamW's no-decay group) is linked while its state is
        still empty and ``safe_get_full_optimizer_state`` then finds no ``exp_avg`` in it. Loading an
        engine checkpoint also rebuilds the mappings without their state (the flag stays set). Linking
        again only takes views (``narrow``) of the state tensors, so it is cheap and safe at any time.
        ZeRO-3 keeps no such link (it has no ``_hp_optimizer_states_linked``)."""
        if hasattr(opt, "_hp_optimizer_states_linked"):
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()

    def portable_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                       keep: Callable[[str], bool]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], list[dict[str, Any]]]:
        """Under ZeRO each parameter's fp32 master and optimizer state are assembled one tensor at a
        time (a collective per tensor, every rank in the same order) and kept only where ``keep``
        says so; without partitioning the engine's optimizer is a plain one (the default)."""
        engine: Any = model
        groups = self._zero_groups(engine)
        if groups is None:
            return super().portable_state(self.unwrap(engine), engine.optimizer, keep)
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # type: ignore[import-untyped]

        module, opt = self.unwrap(engine), engine.optimizer
        self._link_optimizer_state(opt)  # DeepSpeed's own link may predate a group's state (see there)
        names = {id(p): n for n, p in module.named_parameters()}
        aliases: dict[int, list[str]] = {}  # every state_dict name of each parameter (tied weights have several)
        for key, value in module.state_dict(keep_vars=True).items():
            aliases.setdefault(id(value), []).append(key)
        sd: dict[str, torch.Tensor] = {}
        state: dict[str, dict[str, Any]] = {}
        out_groups = []
        for g, params in enumerate(groups):
            flat, base, inner_group = self._flat(opt, g)
            per_param = sorted(k for k, v in base.items() if torch.is_tensor(v) and v.numel() == flat.numel() and v.numel() > 1)
            for p in params:
                name = names[id(p)]
                full = safe_get_full_fp32_param(p)  # collective
                shape = tuple(getattr(p, "ds_shape", p.shape))
                for alias in aliases.get(id(p), [name]):
                    if keep(alias):
                        sd[alias] = full.detach().cpu().reshape(shape).clone()
                for key in per_param:
                    value = safe_get_full_optimizer_state(p, key)  # collective
                    if keep(name):
                        state.setdefault(name, {})[key] = value.detach().cpu().reshape(shape).clone()
                if keep(name):  # the group's scalars (Adam's step): one per flat group, the same for its parameters
                    for key, v in base.items():
                        if key not in per_param:
                            state.setdefault(name, {})[key] = v.detach().cpu().clone() if torch.is_tensor(v) else v
            hyper = {k: v for k, v in inner_group.items() if k != "params"}
            out_groups.append({**hyper, "params": [names[id(p)] for p in params]})
        in_groups = {id(p) for params in groups for p in params}
        for p in module.parameters():  # frozen parameters: in no optimizer group (partitioned under ZeRO-3)
            if id(p) not in in_groups:
                with self._gathered_one(p):
                    for alias in aliases.get(id(p), [names[id(p)]]):
                        if keep(alias):
                            sd[alias] = p.detach().to("cpu", torch.float32).clone()
        for key, value in module.state_dict(keep_vars=True).items():  # buffers (not partitioned)
            if id(value) not in names and keep(key):
                sd[key] = value.detach().cpu().clone()
        return sd, state, out_groups

    def load_portable_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                            sd: dict[str, torch.Tensor], optim_state: dict[str, dict[str, Any]],
                            groups: list[dict[str, Any]]) -> None:
        """Write the fp32 masters and optimizer state of every parameter into this rank's partitions
        (``safe_set_full_*``), then rebuild the 16-bit/partitioned weights from the masters."""
        engine: Any = model
        zgroups = self._zero_groups(engine)
        if zgroups is None:
            super().load_portable_state(self.unwrap(engine), engine.optimizer, sd, optim_state, groups)
            return
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state  # type: ignore[import-untyped]

        from distkit.portable import optimizer_state_from_names

        module, opt = self.unwrap(engine), engine.optimizer
        names = {id(p): n for n, p in module.named_parameters()}
        group_names = [[names[id(p)] for p in g] for g in zgroups]
        optimizer_state_from_names(optim_state, groups, group_names)  # the same groups, or a clear error
        with torch.no_grad():
            for g, params in enumerate(zgroups):
                flat, base, inner_group = self._flat(opt, g)
                first = optim_state.get(group_names[g][0], {}) if group_names[g] else {}
                shape = tuple(sd[group_names[g][0]].shape) if group_names[g] else ()
                per_param = [k for k, v in first.items() if torch.is_tensor(v) and k != "step" and tuple(v.shape) == shape]
                if first and not base:  # a fresh engine: the inner optimizer creates its state at the first step
                    for key, v in first.items():
                        base[key] = torch.zeros_like(flat) if key in per_param else (v.clone() if torch.is_tensor(v) else v)
                    self._link_optimizer_state(opt)  # ZeRO-1/2, bf16: link the new state to the parameters
                for p in params:
                    name = names[id(p)]
                    safe_set_full_fp32_param(p, sd[name].to(self.device))
                    for key in per_param:
                        if key in optim_state.get(name, {}):
                            safe_set_full_optimizer_state(p, optim_state[name][key].to(self.device), key)
                for key, v in first.items():  # the group's scalars
                    if key not in per_param and key in base:
                        base[key] = v.clone() if torch.is_tensor(v) else v
                saved = next(x for x in groups if sorted(x["params"]) == sorted(group_names[g]))
                inner_group.update({k: v for k, v in saved.items() if k != "params"})
            _, refresh = self._masters(engine)
            refresh()  # the model's weights from the masters just written
            in_groups = {id(p) for params in zgroups for p in params}
            for p in module.parameters():  # frozen parameters: no master, set directly (whole under ZeRO-3)
                if id(p) not in in_groups and names[id(p)] in sd:
                    if hasattr(p, "ds_id"):
                        import deepspeed  # type: ignore[import-untyped]

                        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                            if self.rank == 0:
                                p.data.copy_(sd[names[id(p)]].to(p.device, p.dtype))
                    else:
                        p.data.copy_(sd[names[id(p)]].to(p.device, p.dtype))
            params = set(names.values())
            for name, b in module.named_buffers():
                if name in sd and name not in params:
                    b.copy_(sd[name].to(b.device, b.dtype))

    def _engine_dir(self, directory: str) -> str:
        sub = f"group-{self.mpu.index}" if self.mpu is not None else "all"
        return os.path.join(directory, ENGINE_DIR, sub)

    engine_files = True

    def save_engine_files(self, directory: str, model: nn.Module) -> None:
        """Collective: ``engine.save_checkpoint`` into distkit's temporary checkpoint directory, without
        DeepSpeed's ``latest`` file (distkit's manifest + ``latest`` are what a resume trusts)."""
        if model is None:  # dk.save before dk.setup: no engine yet
            return
        path = self._engine_dir(directory)
        os.makedirs(os.path.join(path, TAG), exist_ok=True)  # DeepSpeed creates it on global rank 0 only
        engine: Any = model
        engine.save_checkpoint(path, tag=TAG, client_state={}, save_latest=False)

    def load_engine_files(self, directory: str, model: nn.Module) -> None:
        path = self._engine_dir(directory)
        if not os.path.isdir(os.path.join(path, TAG)):
            raise ConfigError(f"checkpoint '{directory}' holds no DeepSpeed engine state ({path}): it was not written "
                              "by the deepspeed backend with this param_sync_group_size")
        engine: Any = model
        loaded, _ = engine.load_checkpoint(path, tag=TAG, load_module_strict=True, load_optimizer_states=True,
                                           load_lr_scheduler_states=True)
        if loaded is None:
            raise ConfigError(f"DeepSpeed could not load its checkpoint from {path}")


def consolidated_state_dict(checkpoint_dir: str, group: int = 0) -> dict[str, torch.Tensor]:
    """A plain fp32 ``state_dict`` of the whole model from a distkit checkpoint written by this backend,
    any ZeRO stage (not collective; no process group needed). Used by ``distkit export``. Built from the
    optimizer's fp32 master weights where there are any. ``group``: which replica group (param mode)."""
    root = os.path.join(checkpoint_dir, ENGINE_DIR)
    if not os.path.isdir(root):
        raise ConfigError(f"'{checkpoint_dir}' holds no DeepSpeed engine state: export needs a checkpoint of the "
                          "deepspeed backend")
    sub = "all" if os.path.isdir(os.path.join(root, "all")) else f"group-{group}"  # param mode: groups agree after the final sync
    path = os.path.join(root, sub)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    tag_dir = os.path.join(path, TAG)
    if any("zero_pp_rank" in f for f in os.listdir(tag_dir)):
        from deepspeed.utils import zero_to_fp32  # type: ignore[import-untyped]

        sd = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(path, tag=TAG)
    else:  # stage 0 fp32: the model states file holds the whole module
        files = sorted(f for f in os.listdir(tag_dir) if f.endswith("model_states.pt"))
        sd = torch.load(os.path.join(tag_dir, files[0]), map_location="cpu", weights_only=False)["module"]
    return {k: (v.float() if v.is_floating_point() else v).clone() for k, v in sd.items()}
