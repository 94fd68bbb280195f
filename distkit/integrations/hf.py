"""distkit under Hugging Face Accelerate and ``transformers.Trainer`` (``pip install distkit[hf]``).

:class:`ParamSync` is Accelerate's ``LocalSGD`` with distkit's param mode behind it: the same context manager and
``step()`` (a two-line change in a LocalSGD script), bit for bit LocalSGD at its settings, and beyond them distkit's
outer optimizer (DiLoCo), fragments, int8 compression and overlap, driven by :class:`distkit.sync.averager.ParamAverager`
over Accelerate's own torch.distributed group; its per-rank state goes into ``accelerator.save_state``.
``DistkitTrainer`` (:mod:`distkit.integrations.hf_trainer`, loaded on first use so that an Accelerate-only script never imports
transformers) is a ``transformers.Trainer`` whose training runs through a distkit Session.

Only this module and :mod:`distkit.integrations.hf_trainer` import accelerate and transformers; distkit's core never does.
Importing it under ``mpirun`` without ``MASTER_ADDR`` is refused in one line (:func:`refuse_mpirun_without_rendezvous`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import weakref
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from distkit import portable
from distkit.backends.ddp import DDPStrategy
from distkit.backends.parts import param_averager
from distkit.config import RunConfig, resolve
from distkit.config.arguments import Source, config_from
from distkit.config.loader import apply_override
from distkit.config.validate import _validate
from distkit.env import ClusterEnv, detect
from distkit.errors import BackendUnavailable, ConfigError, UnsupportedCombination, UsageError
from distkit.health.guards import install_excepthook
from distkit.session import Session

#: the launchers whose ranks Accelerate finds from MPI's variables, with no rendezvous address of theirs
_MPI_LAUNCHERS = ("openmpi", "mpich", "pmix")


def refuse_mpirun_without_rendezvous(environ: Optional[Mapping[str, str]] = None) -> None:
    """Not collective (every rank sees the same launcher). Under ``mpirun`` with 2+ ranks and no ``MASTER_ADDR``,
    Accelerate's state (``TrainingArguments``, ``Accelerator()``, the script's next lines) starts torch.distributed
    by ``env://`` and dies in a traceback ("MASTER_ADDR expected, but not set"), before any distkit code runs again:
    so this runs when distkit.hf is imported and refuses in one line, exit 2 (UnsupportedCombination), naming
    what works. With ``MASTER_ADDR`` (and ``MASTER_PORT``) exported both bridges run under mpirun."""
    environ = dict(os.environ) if environ is None else environ
    if environ.get("MASTER_ADDR"):
        return
    try:
        env = detect(environ)
    except ConfigError:
        return  # (a launcher layout distkit cannot read: Accelerate may; not ours to refuse here)
    if env.launcher in _MPI_LAUNCHERS and env.world_size > 1:
        install_excepthook(lambda: Session.current)  # raised at import, before distkit.init could install it
        raise UnsupportedCombination(
            f"DistkitTrainer and ParamSync run on Accelerate's torch.distributed group, which starts from MASTER_ADDR "
            f"and MASTER_PORT, and mpirun ({env.launcher}) gave its {env.world_size} ranks no MASTER_ADDR: launch "
            f"with torchrun --nproc_per_node {env.world_size} (or accelerate launch), or export both to every rank "
            "(mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<a free port> ...)")


refuse_mpirun_without_rendezvous()

try:
    from accelerate import Accelerator, DistributedType
except ImportError:  # one line instead of a traceback, with the install command
    raise BackendUnavailable("distkit.hf needs Hugging Face Accelerate: pip install 'distkit[hf]' "
                             "(accelerate>=1.10, transformers>=4.46)") from None

# DistkitTrainer: distkit.integrations.hf_trainer (distkit.hf re-exports it and ParamSync)
__all__ = ["ParamSync", "param_config", "refuse_mpirun_without_rendezvous"]

#: Accelerate's distributed types LocalSGD accepts (accelerate/local_sgd.py): DDP-style data parallelism only
_LOCAL_SGD_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_MLU", "MULTI_HPU", "MULTI_SDAA", "MULTI_MUSA",
                    "MULTI_NPU", "MULTI_NEURON")
#: where each rank's own state of a ``save_state`` directory goes (Accelerate writes rank 0's model and optimizer)
RANK_DIR = "distkit_param_sync"
#: per prepared model: the config it was built for and its averager, so that a new ParamSync per epoch (the shape of
#: Accelerate's example) keeps the outer optimizer's momentum, the anchor and the fragment clock of the last one
_AVERAGERS: "weakref.WeakKeyDictionary[nn.Module, tuple[str, Any]]" = weakref.WeakKeyDictionary()


def param_config(config: Source = None, local_sgd_steps: Optional[int] = None, **keys: Any) -> RunConfig:
    """A validated RunConfig in param mode from any source :func:`distkit.init` takes (a dict, config file path(s),
    an ``argparse.Namespace`` from :func:`distkit.add_arguments` with its ``++key value`` pairs, a RunConfig) plus
    ``keys``; ``reduce_type = 'param'`` is implied, and ``local_sgd_steps`` (when given) is ``param_sync_step``."""
    forced: dict[str, Any] = {"distributed.reduce_type": "param"}
    if local_sgd_steps is not None:
        forced["distributed.param_sync_step"] = local_sgd_steps
    if isinstance(config, RunConfig):
        if keys:
            raise UsageError("ParamSync(config=RunConfig, **keys): put the keys into the RunConfig, or pass a dict")
        step = config.distributed.param_sync_step if local_sgd_steps is None else local_sgd_steps
        # a copy: the caller's RunConfig stays as it was (it may configure distkit's own loop too)
        cfg = dataclasses.replace(config, distributed=dataclasses.replace(
            config.distributed, reduce_type="param", param_sync_step=step))
        _validate(cfg)
        return cfg
    if config is None or isinstance(config, dict):  # dotted keys set into a copy (the user's dict stays as it was)
        raw = dict(config or {})
        if isinstance(raw.get("distributed"), dict):
            raw["distributed"] = dict(raw["distributed"])
        for key, value in [*keys.items(), *forced.items()]:
            apply_override(raw, key, value)
        return resolve(raw)
    return config_from(config, **{**keys, **forced})[0]


def _uses_averager(cfg: RunConfig) -> bool:
    """Whether ``cfg`` asks for more than LocalSGD does (a plain mean of the parameters every K calls)."""
    d = cfg.distributed
    return (d.outer_optimizer is not None or d.param_sync_fragments > 1 or d.param_sync_compression != "none"
            or d.param_sync_overlap > 0 or d.param_sync_time_diff is not None)


class ParamSync:
    """Accelerate's ``LocalSGD`` on distkit's param mode: ``with ParamSync(accelerator, model, local_sgd_steps=K) as
    sync:`` around the training loop, ``sync.step()`` after each ``optimizer.step()``.

    Inside the block the prepared (DDP) model runs under its ``no_sync()``: no gradient all-reduce, each rank steps
    on its own; ``step()`` counts calls (micro-batches, when called inside ``accelerator.accumulate``, as LocalSGD)
    and syncs at every K-th; leaving the block syncs (an exception leaving it does not: the other ranks may not be
    there). The block may be entered again (one ParamSync across epochs, registered for checkpointing once).

    At LocalSGD's settings (``config`` asks for nothing more) a sync is LocalSGD's own: per parameter, in
    ``model.parameters()`` order, ``accelerator.reduce(p.data, "mean")`` (a clone, a SUM all-reduce over the world,
    a division by the world size) rebound as ``p.data``; buffers untouched: bit for bit LocalSGD. With
    ``param_outer_optimizer``, ``param_sync_fragments``, ``param_sync_compression``, ``param_sync_overlap`` or
    ``param_sync_time_diff`` set, distkit's :class:`~distkit.sync.averager.ParamAverager` syncs, as in distkit's own
    loop: parameters and floating buffers, the same schedule and arithmetic (equal to ``distkit.init`` in param mode
    on the same per-rank batches).

    Args:
        accelerator: the ``Accelerator`` (DDP-style: not DeepSpeed, FSDP, Megatron-LM or XLA, as LocalSGD).
        model: the model ``accelerator.prepare`` returned.
        local_sgd_steps: K, calls of :meth:`step` between syncs; None takes ``distributed.param_sync_step``.
        enabled: False (or a single process) turns every sync off; ``step()`` still counts.
        config: distkit config: a dict, config file path(s), an ``argparse.Namespace`` from
            :func:`distkit.add_arguments` (``--config``, ``++key value``) or a RunConfig; ``keys`` override it.

    Cross-rank contract: ``step()`` (when it syncs; with ``param_sync_time_diff`` at every call) and leaving the
    block are collective: every rank calls them the same number of times, in the same order relative to its other
    collectives (with int8 or overlap the first exchange also creates a process group). So is
    ``accelerator.load_state`` when an exchange was in flight at the save. The constructor and ``state_dict()`` are
    not. An uncaught distkit error prints one line ``distkit: error: ...`` (as under ``distkit.init``).
    """

    def __init__(self, accelerator: Accelerator, model: nn.Module, local_sgd_steps: Optional[int] = None,
                 enabled: bool = True, config: Source = None, **keys: Any) -> None:
        install_excepthook(lambda: Session.current)  # a refusal below is one line, as under distkit.init
        allowed = {getattr(DistributedType, n) for n in _LOCAL_SGD_TYPES if hasattr(DistributedType, n)}
        if accelerator.distributed_type not in allowed:
            raise UnsupportedCombination(
                f"ParamSync (like Accelerate's LocalSGD) needs DDP-style data parallelism, not "
                f"{accelerator.distributed_type}: for param mode on DeepSpeed or FSDP use distkit's own loop "
                "(distkit.init with distributed = {'backend': 'deepspeed' or 'fsdp', 'reduce_type': 'param'})")
        self.cfg = param_config(config, local_sgd_steps, **keys)
        d = self.cfg.distributed
        if d.backend != "ddp":
            raise ConfigError(f"ParamSync averages over Accelerate's torch.distributed group: distributed.backend "
                              f"must be 'ddp' (got {d.backend!r}): remove it, or use distkit's own loop for {d.backend}")
        if d.param_sync_group_size != 1 or self.cfg.fault_tolerance:
            raise UnsupportedCombination("ParamSync: param_sync_group_size and fault_tolerance need distkit's own "
                                         "loop (distkit.init): remove them here")
        self.accelerator, self.model = accelerator, model
        self.local_sgd_steps: int = d.param_sync_step
        self.enabled = bool(enabled) and accelerator.distributed_type != DistributedType.NO
        #: calls of step() so far (LocalSGD's counter; restored by load_state_dict)
        self.num_steps = 0
        self._no_sync: Any = None
        #: distkit's averager where the config asks for more than LocalSGD, else None (LocalSGD's own sync)
        self.averager: Any = self._averager() if self.enabled and _uses_averager(self.cfg) else None
        if self.enabled:
            _install_hooks(accelerator)

    def _averager(self) -> Any:
        """The :class:`~distkit.sync.averager.ParamAverager` of the bare model on distkit's ddp Strategy, which adopts
        the process group Accelerate initialised (``DDPStrategy.init`` returns when one exists); the same one
        for a later ParamSync of the same model and config."""
        module = self.accelerator.unwrap_model(self.model)
        key = json.dumps(self.cfg.to_json()["distributed"], sort_keys=True)
        known = _AVERAGERS.get(module)
        if known is not None and known[0] == key:
            return known[1]
        if not dist.is_initialized():
            raise UnsupportedCombination("ParamSync's distkit extras exchange over torch.distributed, which Accelerate "
                                         "did not initialise: launch with accelerate launch or torchrun")
        world = dist.get_world_size()
        env = ClusterEnv(rank=dist.get_rank(), local_rank=self.accelerator.local_process_index, world_size=world,
                         local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)), node_rank=0, num_nodes=1,
                         master_addr=None, master_port=None, launcher="accelerate", job_id=None, nodelist=None)
        strategy = DDPStrategy(self.cfg, env, self.accelerator.device)
        strategy.init()  # adopts Accelerate's group: no rendezvous of its own
        strategy.pg_backend = dist.get_backend()
        averager = param_averager(strategy, module)
        _AVERAGERS[module] = (key, averager)
        return averager

    # -- LocalSGD's shape ------------------------------------------------------------------------------------
    def __enter__(self) -> "ParamSync":
        if self.enabled:
            if not hasattr(self.model, "no_sync"):
                raise UsageError("ParamSync(accelerator, model): pass the model accelerator.prepare returned (its DDP "
                                 "wrapper's no_sync turns the gradient all-reduce off)")
            self._no_sync = self.model.no_sync()
            self._no_sync.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enabled or self._no_sync is None:
            return
        try:
            if exc_type is None:  # (with an error on its way out this rank may be alone: no collective)
                self.sync_now()
        finally:
            self._no_sync.__exit__(exc_type, exc, tb)
            self._no_sync = None

    def step(self) -> None:
        """Collective when it syncs: count one call; every ``local_sgd_steps``-th call syncs (with distkit's
        extras, the averager's schedule: fragments, overlap, the time rule, counted in calls)."""
        self.num_steps += 1
        if not self.enabled:
            return
        if self.averager is not None:
            self.averager.after_step()
        elif self.num_steps % self.local_sgd_steps == 0:
            self._local_sgd_average()

    def sync_now(self) -> None:
        """Collective: sync now (what leaving the block does): LocalSGD's average, or the averager's final sync
        (exchanges in flight applied, every fragment with local steps synced)."""
        if self.averager is not None:
            self.averager.final_sync()
        else:
            self._local_sgd_average()

    def _local_sgd_average(self) -> None:
        """LocalSGD's ``_sync_and_avg_model_params``, op for op (the bit-for-bit contract)."""
        self.accelerator.wait_for_everyone()
        with self.accelerator.autocast():
            for param in self.model.parameters():
                param.data = self.accelerator.reduce(param.data, reduction="mean")

    # -- checkpoints (accelerator.register_for_checkpointing(sync)) ----------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What is the same on every rank (Accelerate keeps rank 0's): the counters. Each rank's own model,
        optimizers and averager state go to ``<save_state dir>/distkit_param_sync/rank-NNNNN.pt`` (a save hook)."""
        state: dict[str, Any] = {"num_steps": self.num_steps, "local_sgd_steps": self.local_sgd_steps}
        if self.averager is not None:
            state["averager_counters"] = self.averager._counters()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Collective with overlap (an exchange in flight at the save starts again). Runs last in
        ``accelerator.load_state`` (after rank 0's model and optimizers were loaded): this rank's own file, when
        the checkpoint has one per rank of this world, puts back this rank's model, optimizers and averager
        state; else every rank continues from rank 0's model in a new period."""
        self.num_steps = int(state["num_steps"])
        loaded = _rank_file(self.accelerator)
        if loaded is None:
            if self.averager is not None:
                self.averager.restart()
            return
        if not getattr(self.accelerator, "_distkit_models_restored", False):
            for m, sd in zip(self.accelerator._models, loaded["models"], strict=True):
                self.accelerator.unwrap_model(m).load_state_dict(sd)
            for o, sd in zip(self.accelerator._optimizers, loaded["optimizers"], strict=True):
                o.load_state_dict(sd)
            self.accelerator._distkit_models_restored = True
        if hasattr(self.model, "require_forward_param_sync"):
            # DDP broadcasts rank 0's buffers before its first forward (then not again inside no_sync): the run
            # that saved had passed that point, so this rank keeps its own buffers (BatchNorm statistics)
            self.model.require_forward_param_sync = False
        mine = loaded["syncs"].get(_index(self.accelerator, self))
        if self.averager is not None:
            if mine is not None:
                self.averager.load_state_dict(mine)
            else:
                self.averager.restart()


def _index(accelerator: Accelerator, sync: ParamSync) -> int:
    """``sync``'s place among the registered checkpoint objects (the key of its state in the rank files)."""
    return next(i for i, o in enumerate(accelerator._custom_objects) if o is sync)


def _install_hooks(accelerator: Accelerator) -> None:
    """Once per Accelerator: a save pre-hook that writes this rank's file (every rank runs it; Accelerate then
    writes rank 0's), and a load pre-hook that notes the directory for :meth:`ParamSync.load_state_dict`."""
    if getattr(accelerator, "_distkit_hooks", False):
        return

    def save(models: list[Any], weights: list[Any], output_dir: str) -> None:
        syncs = {i: o for i, o in enumerate(accelerator._custom_objects) if isinstance(o, ParamSync) and o.enabled}
        if not syncs:
            return  # (no ParamSync registered for checkpointing: nothing of ours to keep)
        state = {"world_size": accelerator.num_processes,
                 "models": [accelerator.unwrap_model(m).state_dict() for m in accelerator._models],
                 "optimizers": [o.state_dict() for o in accelerator._optimizers],
                 "syncs": {i: s.averager.state_dict() for i, s in syncs.items() if s.averager is not None}}
        directory = os.path.join(output_dir, RANK_DIR)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"rank-{accelerator.process_index:05d}.pt")
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # whole or absent, never half written

    def load(models: list[Any], input_dir: str) -> None:
        accelerator._distkit_load_dir = input_dir
        accelerator._distkit_models_restored = False
        accelerator._distkit_loaded = None  # (the directory may have been written again since)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    accelerator._distkit_hooks = True


def _rank_file(accelerator: Accelerator) -> Optional[dict[str, Any]]:
    """This rank's state from the directory ``load_state`` reads, when the checkpoint holds one file per rank of a
    world of this size (every rank sees the same directory, so all decide alike); else None."""
    directory = getattr(accelerator, "_distkit_load_dir", None)
    if directory is None:
        return None
    files = os.path.join(directory, RANK_DIR)
    names = sorted(os.listdir(files)) if os.path.isdir(files) else []
    if names != [f"rank-{r:05d}.pt" for r in range(accelerator.num_processes)]:
        return None
    cached = getattr(accelerator, "_distkit_loaded", None)
    if cached is None or cached[0] != directory:
        state = portable.load_file(os.path.join(files, f"rank-{accelerator.process_index:05d}.pt"))
        cached = accelerator._distkit_loaded = (directory, state)
    return cached[1]  # type: ignore[no-any-return]

