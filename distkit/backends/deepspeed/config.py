"""The DeepSpeed config: resolution, checks against distkit's keys, and the backend's constants.

Config: the DeepSpeed JSON (``cfg.distributed.deepspeed_config``) is honoured; where a
DeepSpeed key and a distkit key overlap (batch size, accumulation, clipping, optimizer)
they must agree or :meth:`DeepSpeedStrategy.check_config` raises ConfigError naming
both. ``gradient_clip`` <-> ``gradient_clipping``: DeepSpeed's own default is 1.0, distkit's
is "no clipping"; distkit always writes the key, so a run clips only if one of the two
says so. The resolved JSON is written to ``output_dir/deepspeed_config.resolved.json``.
"""
from __future__ import annotations

import copy
import importlib.util
import os
from typing import Any, Optional

from distkit.config import RunConfig
from distkit.config.validate import uses_muon
from distkit.env import detect
from distkit.errors import BackendUnavailable, ConfigError, UnsupportedCombination

from ..ddp import DDPStrategy

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


def muon_refusal(stage: int, precision: str) -> str:
    """The one line refusing Muon (:class:`distkit.components.MuonWithAdamW`) under DeepSpeed ``stage``/``precision``:
    ZeRO 1-3 and the bf16/fp16 optimizers hand the client optimizer flat 1-D partitions, not whole matrices."""
    what = f"ZeRO stage {stage}" if stage >= 1 else f"precision {precision!r}"
    return (f"optimizer 'muon' orthogonalises whole weight matrices, which DeepSpeed {what} flattens into partitions: "
            "use backend 'ddp', 'mpi', 'horovod' or 'fsdp' for Muon, or DeepSpeed ZeRO stage 0 with precision '32'")


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


class _DeepSpeedConfigured(DDPStrategy):
    """The base of :class:`~distkit.backends.deepspeed.engine.DeepSpeedStrategy`: its checks and
    resolution of the DeepSpeed config (before any process group, and once the world size is known)."""

    #: the batch size per rank of the first dk.dataloader made before setup (note_loader_batch)
    _loader_micro: Optional[int] = None

    def note_loader_batch(self, batch_size: int) -> None:
        """DeepSpeed is told the micro batch at ``setup`` (its ``train_micro_batch_size_per_gpu`` and
        ``train_batch_size``, also written to ``deepspeed_config.resolved.json``); where neither distkit's config nor
        the DeepSpeed config gives one, the first loader made before setup does: the batch the script uses, not
        the config's default of 32. Reporting only: DeepSpeed's arithmetic uses the accumulation, which is right."""
        if self._loader_micro is None and getattr(self, "engine", None) is None:
            self._loader_micro = batch_size

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
        if uses_muon(cfg.optimizer) and "optimizer" not in ds and (stage >= 1 or cfg.precision != "32"):
            raise UnsupportedCombination(muon_refusal(stage, cfg.precision))
        if "scheduler" in ds and cfg.lr_scheduler is not None:
            raise ConfigError("'lr_scheduler' (distkit) and the 'scheduler' block of the DeepSpeed config both choose "
                              "the LR schedule: remove one of them")
        if cfg.fault_tolerance and stage >= 1 and _group_size(cfg) > 1:
            # a heal copies state rank by rank from live groups that torchft picks per rank: shards of one
            # optimizer state cannot be put together that way (whole states can: distkit.ft.groups)
            raise UnsupportedCombination(f"fault_tolerance with ZeRO stage {stage} shards the optimizer state over "
                                         "the ranks of a group, which a heal cannot copy rank by rank: use ZeRO stage "
                                         "0 inside fault-tolerant groups, or one rank per group")
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
        known = getattr(cfg, "_deepspeed_known", {"micro": True})
        micro = (self._loader_micro if self._loader_micro is not None and not known["micro"]
                 and "train_batch_size" not in conf else cfg.batch_size)
        conf["train_micro_batch_size_per_gpu"] = micro
        conf["gradient_accumulation_steps"] = cfg.accum_grad_multiple_step
        conf["train_batch_size"] = micro * cfg.accum_grad_multiple_step * self._data_parallel_size()
        conf["gradient_clipping"] = float(cfg.gradient_clip or 0.0)  # explicit: DeepSpeed's own default is 1.0
        if client_optimizer:
            conf.setdefault("zero_allow_untested_optimizer", True)
        if _offload_device(zero_section(conf), "offload_optimizer") != "none":
            conf.setdefault("zero_force_ds_cpu_optimizer", False)  # torch optimizers work; CPUAdam needs a compiler
        conf.setdefault("steps_per_print", 10 ** 9)  # distkit logs; DeepSpeed prints only if asked
        return conf


def _group_size(cfg: RunConfig) -> int:
    """The ranks of this launch, before start: ``--nprocs``, or the world size the launcher gave this process
    (torchrun, mpirun, SLURM, ...: :func:`distkit.env.detect`)."""
    return max(cfg.nprocs, detect(os.environ).world_size)
