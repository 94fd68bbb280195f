"""distkit under a SpeechBrain recipe: ``import distkit.speechbrain as sb`` in place of ``import speechbrain as sb``.

That one line gives the recipe SpeechBrain's whole namespace (``sb.Stage``, ``sb.dataio``, ``sb.utils`` ...) with
``sb.Brain`` replaced by :class:`Brain`, whose training runs through a :class:`distkit.Session`: one config key picks
the engine (``distributed.backend``: ddp, deepspeed, fsdp, mpi, horovod) and the mode (``distributed.reduce_type``:
"grad" or "param", DiLoCo and the rest of param mode's options included). A recipe that keeps ``import speechbrain as
sb`` may subclass ``distkit.speechbrain.Brain`` instead (then data preparation that runs before the Brain is made is
not yet routed: see :func:`ddp_init_group`).

The config comes from (later wins): ``--config FILE`` (distkit's config files), a ``distributed:`` block in the
recipe's hparams YAML (plain values), and ``++key value`` on the command line (``++distributed.backend mpi``,
``++use_horovod True``); ``--nprocs N`` starts N ranks. distkit's flags are taken out of ``sys.argv`` when this module
is imported, so SpeechBrain's own parser never sees them. SpeechBrain's command lines keep working::

    torchrun --nproc_per_node 2 train.py hparams.yaml                      # ddp (deepspeed, fsdp: ++distributed.backend)
    mpirun -np 2 python train.py hparams.yaml ++use_horovod True           # horovod (mpi: ++distributed.backend mpi)
    python train.py hparams.yaml --nprocs 2 ++distributed.reduce_type param

What the Brain changes, and why each is SpeechBrain's DDP result:

* ``_wrap_distributed``: no DDP per module. The modules with trainable parameters go, as one module whose forward is
  the recipe's ``compute_forward``, to ``dk.setup`` with the optimizer ``init_optimizers`` made (rank 0's state
  everywhere, the engine's wrapper or reducer, param mode's averager). ``self.compute_forward`` then runs through the
  engine, from ``fit_batch``, ``evaluate_batch`` or the recipe's own code. No SyncBatchNorm conversion (SpeechBrain's
  DDP converts, which needs CUDA): BatchNorm statistics are DDP's without it (rank 0's broadcast before each training
  forward, each rank's own update).
* ``fit_batch``/``optimizers_step``: SpeechBrain's (``loss / grad_accumulation_factor``, micro-steps inside
  ``dk.no_sync``), with ``dk.backward`` and ``dk.step``. Clipping is SpeechBrain's: ``max_grad_norm`` over the first
  param group only, on the reduced gradients (on DeepSpeed the engine clips, which needs one param group).
* The training sampler is SpeechBrain's ``DistributedSampler`` (or its wrapper) over distkit's ranks, under every
  launcher; the intra-epoch checkpoint decision is rank 0's, broadcast through the engine.
* SpeechBrain's helpers (``run_on_main``, ``if_main_process``, ``main_process_only``, ``ddp_barrier``,
  ``ddp_broadcast``, ``ddp_all_reduce``) run on the engine's collectives under every engine, so exactly one rank
  writes (the checkpointer, the loggers, data preparation) without a second process group or listening socket.
* Checkpoints: the recipe's ``Checkpointer`` keeps its files (rank 0's, in param mode the mean of the replicas) and
  gains one recoverable, ``distkit``: every rank's model, optimizer and param-mode state (``dk.save``), which
  ``recover_if_possible`` at the start of ``fit`` restores on every rank (a kill -9 mid-epoch resumes the same run).
* Param mode: validation, the checkpoint's model files and ``evaluate`` see the mean of the replicas while they
  differ (:class:`~distkit.integrations.replicas.ReplicaMean`); ``fit`` ends with the final sync (``dk.finish``).

Refused before training, one line, exit 2: ``--data_parallel_backend``, fp16 (SpeechBrain refuses it on the CPU; a
GradScaler steps the optimizer itself), several optimizers, an epoch whose batch count is not a multiple of
``grad_accumulation_factor`` (SpeechBrain drops the tail's gradients, which DeepSpeed and Horovod cannot), clipping
several param groups on DeepSpeed. A non-finite loss stops at once (``NonFiniteLoss``) instead of SpeechBrain's
``nonfinite_patience``.

Nothing else in distkit imports this module (it imports speechbrain).
"""
from __future__ import annotations

import contextlib
import os
import random
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch import nn

from distkit.errors import BackendUnavailable, UnsupportedCombination, UsageError
from distkit.health import faults
from distkit.integrations.replicas import ReplicaMean
from distkit.integrations.speechbrain_job import (ddp_init_group, distkit_errors_first, given_option, join,
                                                  options_dict, parse_arguments, refuse_data_parallel, run_option)


__all__ = ["Brain", "ddp_init_group", "join", "parse_arguments"]

try:
    import speechbrain as _sb
    import speechbrain.utils.distributed as _sbdist
    from speechbrain.utils.checkpoints import Checkpointer
except ImportError:
    raise BackendUnavailable("distkit.speechbrain needs SpeechBrain: pip install 'distkit[speechbrain]'") from None

from torch.utils.data import DistributedSampler, IterableDataset

#: the name of distkit's recoverable in the recipe's Checkpointer (a directory ``distkit.ckpt`` in each CKPT+...)
RECOVERABLE = "distkit"


# -- the Brain ------------------------------------------------------------------------------------------------------
class _Forward(nn.Module):
    """The Brain's trainable modules as the one model an engine wraps; its forward is the recipe's
    ``compute_forward`` (so DDP's reducer, ZeRO's and FSDP's gathers and the buffer broadcast see the step)."""

    def __init__(self, brain: "Brain", modules: dict[str, nn.Module]) -> None:
        super().__init__()
        self.brain_modules = nn.ModuleDict(modules)
        object.__setattr__(self, "_brain", brain)  # (not a submodule: the Brain is no nn.Module)

    def forward(self, batch: Any, stage: Any) -> Any:
        brain = self._brain
        return type(brain).compute_forward(brain, batch, stage)


class Brain(_sb.Brain):
    """``speechbrain.Brain`` whose training runs on distkit's engines and modes (see the module's docstring).

    Cross-rank contract: as SpeechBrain's under DDP: every rank makes the Brain (collective: joins the job) and runs
    ``fit``/``evaluate`` with the same data sizes; the checkpointer's ``save_and_keep_only`` and
    ``recover_if_possible`` are collective (every rank calls them, as SpeechBrain's own loop does).
    """

    def __init__(self, modules: Any = None, opt_class: Any = None, hparams: Optional[dict[str, Any]] = None,
                 run_opts: Any = None, checkpointer: Optional[Checkpointer] = None) -> None:
        refuse_data_parallel(run_opts)
        dk = join(run_opts, hparams)
        distkit_errors_first()  # (the recipe made its experiment directory by now, as SpeechBrain's recipes do)
        if run_option(run_opts, "precision") == "fp16" or run_option(run_opts, "eval_precision") == "fp16":
            raise _refusal("distkit.speechbrain.Brain with --precision fp16 (a GradScaler steps the optimizer "
                           "itself): use --precision bf16 or fp32")
        if not given_option(run_opts, "device") and (hparams is None or "device" not in hparams):
            run_opts = dict(options_dict(run_opts), device=str(dk.device))
        super().__init__(modules, opt_class, hparams, run_opts, checkpointer)
        self.dk = dk
        self.rank = dk.rank
        self.distributed_launch = dk.world_size > 1  # every launcher, not only torchrun's RANK/LOCAL_RANK
        self._replicas = ReplicaMean(dk)
        self._forward: Optional[nn.Module] = None
        self._resuming = False
        self._rng_at_batch: Optional[tuple[Any, Any, Any]] = None
        if self.checkpointer is not None:
            self.checkpointer.add_recoverable(RECOVERABLE, self, custom_load_hook=Brain._load_rank_state,
                                              custom_save_hook=Brain._save_rank_state, optional_load=True)

    # -- set-up ----------------------------------------------------------------------------------------------------
    def _wrap_distributed(self) -> None:
        """No DDP per module: :meth:`on_fit_start` sets the modules up through distkit after the optimizer."""

    def on_fit_start(self) -> None:
        """SpeechBrain's order (compile, optimizers, recover), with ``dk.setup`` between the optimizer and the
        recovery (collective), whose ``distkit`` recoverable then restores every rank's own state."""
        self._compile()
        self._wrap_distributed()
        self.init_optimizers()
        self._setup()
        if self.checkpointer is not None:
            self._resuming = True
            try:
                self.checkpointer.recover_if_possible()
            finally:
                self._resuming = False

    def _setup(self) -> None:
        """Collective, once: ``dk.setup`` of the trainable modules and the optimizer."""
        if self._forward is not None:
            return
        optimizers = dict(self.optimizers_dict or ({"optimizer": self.optimizer} if self.opt_class else {}))
        if len(optimizers) > 1:
            raise _refusal(f"distkit.speechbrain.Brain steps one optimizer (one distkit Session), init_optimizers "
                           f"made {len(optimizers)} ({', '.join(optimizers)}): use one optimizer with several param "
                           "groups, or speechbrain.Brain under torchrun")
        trainable = {k: m for k, m in self.modules.items() if any(p.requires_grad for p in m.parameters())}
        if not optimizers or not trainable:
            return  # nothing to train here (an evaluation-only Brain): the modules stay as they are
        (key, optimizer), = optimizers.items()
        factor = int(self.grad_accumulation_factor)
        self.dk.set_accumulation(factor)
        groups = len(optimizer.param_groups)
        if self.max_grad_norm and not self.dk._strategy.grads_in_params:
            if groups > 1:
                raise _refusal(f"max_grad_norm on {self.dk._strategy.backend_impl()} with {groups} param groups: "
                               "SpeechBrain clips the first group only, which this engine (it clips inside its "
                               "step) cannot: --max_grad_norm 0, or one param group")
            self.dk.cfg.gradient_clip = float(self.max_grad_norm)  # the engine clips the one group in its step
        if self.find_unused_parameters:  # SpeechBrain's run option: DDP's own keyword (distributed.options)
            self.dk.cfg.distributed.options.setdefault("find_unused_parameters", True)
        model = _Forward(self, trainable)
        wrapped, optimizer = self.dk.setup(model, optimizer)
        self._forward = wrapped
        self.optimizer = optimizer
        if self.optimizers_dict is not None:
            self.optimizers_dict = {key: optimizer}
        if self.checkpointer is not None:  # every rank's own state: the distkit recoverable's (dk.save)
            if self.dk.forward_is_collective:  # FSDP, ZeRO-3: the modules hold this rank's parts only
                self._save_modules_whole(trainable)
            if self.dk.forward_is_collective or not self.dk._strategy.grads_in_params:
                # FSDP, ZeRO: the optimizer holds this rank's partition, which rank 0's file would give every rank
                self.checkpointer.recoverables.pop(key, None)
                self.checkpointer.recoverables.pop("optimizer", None)
            else:  # the engine's optimizer (Horovod's is another object, with the state that steps)
                for name in [n for n in (key, "optimizer") if n in self.checkpointer.recoverables]:
                    self.checkpointer.recoverables[name] = optimizer
                    self.checkpointer.custom_save_hooks[name] = _save_optimizer
                    self.checkpointer.custom_load_hooks[name] = _load_optimizer
            # restored after every other recoverable (they are loaded in this order): its state wins
            self.checkpointer.recoverables[RECOVERABLE] = self.checkpointer.recoverables.pop(RECOVERABLE)
        # From here on the recipe's compute_forward (from fit_batch, evaluate_batch or its own code) runs through
        # the engine's wrapper; _Forward calls the class's method, so this is no recursion.
        self.compute_forward = self._engine_forward  # type: ignore[method-assign]

    def _save_modules_whole(self, trainable: dict[str, nn.Module]) -> None:
        """Where the engine shards the modules, the recipe's Checkpointer files of them hold whole tensors (what
        SpeechBrain's DDP writes: a pretrainer or a single-process ``evaluate`` loads them), gathered by every rank
        (``dk.state_dict``, collective) and written by rank 0; ``evaluate``'s recovery loads them back into the
        shards. (A resumed ``fit`` restores the distkit recoverable's per-rank state instead.)"""
        checkpointer = self.checkpointer
        assert checkpointer is not None
        prefix = {id(m): f"brain_modules.{name}." for name, m in trainable.items()}
        for name, obj in checkpointer.recoverables.items():
            if id(obj) in prefix:
                checkpointer.custom_save_hooks[name] = _whole_saver(self, prefix[id(obj)])
                checkpointer.custom_load_hooks[name] = _whole_loader(self, prefix[id(obj)])

    def _engine_forward(self, batch: Any, stage: Any) -> Any:
        assert self._forward is not None
        return self._forward(batch, stage)

    # -- training ------------------------------------------------------------------------------------------------
    def make_dataloader(self, dataset: Any, stage: Any, ckpt_prefix: Optional[str] = "dataloader-",
                        **loader_kwargs: Any) -> Any:
        """SpeechBrain's; the training loader's batch count must be a multiple of ``grad_accumulation_factor``."""
        loader = super().make_dataloader(dataset, stage, ckpt_prefix, **loader_kwargs)
        factor = int(self.grad_accumulation_factor)
        if stage == _sb.Stage.TRAIN and factor > 1 and hasattr(loader, "__len__"):
            tail = len(loader) % factor
            if self.dk.world_size > 1:  # agreed by every rank (collective): they stop together, one line for all
                tail = int(self.dk.all_reduce(torch.tensor(float(tail)), "max").item())
            if tail:
                raise _refusal(f"grad_accumulation_factor {factor} with {len(loader)} training batches per epoch on "
                               f"this rank: SpeechBrain drops the gradients of the last {tail} batches, which "
                               "distkit's engines cannot; choose a batch size or drop_last so the count is a "
                               "multiple of the factor")
        return loader

    def _train_loader_specifics(self, dataset: Any, loader_kwargs: dict[str, Any]) -> dict[str, Any]:
        """SpeechBrain's DistributedSampler (or wrapper) logic, over distkit's ranks under every launcher."""
        if self.dk.world_size == 1 or isinstance(dataset, IterableDataset):
            return super()._train_loader_specifics(dataset, loader_kwargs)
        from speechbrain.dataio.sampler import DistributedSamplerWrapper

        world, rank = self.dk.world_size, self.dk.rank
        sampler = loader_kwargs.get("sampler", None)
        shuffle = loader_kwargs.get("shuffle", False)
        shuffle_ddp = getattr(self.hparams, "sorting", "random") == "random" if hasattr(self, "hparams") else True
        drop_last = loader_kwargs.get("drop_last", False)
        if sampler is not None:
            self.train_sampler = DistributedSamplerWrapper(sampler, num_replicas=world, rank=rank,
                                                           drop_last=drop_last, shuffle=shuffle)
            loader_kwargs["shuffle"] = False
            loader_kwargs["sampler"] = self.train_sampler
        elif loader_kwargs.get("batch_sampler") is None:
            self.train_sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle_ddp,
                                                    drop_last=drop_last)
            loader_kwargs["shuffle"] = False
            loader_kwargs["sampler"] = self.train_sampler
        else:
            self.train_sampler = DistributedSamplerWrapper(loader_kwargs.get("batch_sampler", None),
                                                           num_replicas=world, rank=rank, shuffle=shuffle_ddp)
            loader_kwargs["batch_sampler"] = self.train_sampler
        return loader_kwargs

    def fit_batch(self, batch: Any) -> torch.Tensor:
        """SpeechBrain's ``fit_batch`` on the engine: micro-steps inside ``dk.no_sync``, ``dk.backward`` of
        ``loss / grad_accumulation_factor``, :meth:`optimizers_step` every ``grad_accumulation_factor`` batches
        (collective in grad mode)."""
        if self._forward is None:
            raise UsageError("distkit.speechbrain.Brain.fit_batch before on_fit_start set the modules up: call "
                             "super().on_fit_start() in an on_fit_start of your own")
        should_step = (self.step % self.grad_accumulation_factor) == 0
        self.on_fit_batch_start(batch, should_step)
        with self.dk.no_sync() if not should_step else contextlib.nullcontext():
            with self.training_ctx:
                outputs = self.compute_forward(batch, _sb.Stage.TRAIN)
                loss = self.compute_objectives(outputs, batch, _sb.Stage.TRAIN)
            scaled_loss = loss / self.grad_accumulation_factor
            self.check_loss_isfinite(scaled_loss)
            self.dk.backward(scaled_loss)
        if should_step:
            self.optimizers_step()
        self.on_fit_batch_end(batch, outputs, loss, should_step)
        return loss.detach().cpu()

    def optimizers_step(self) -> None:
        """Collective in grad mode: SpeechBrain's clipping (the first param group, ``max_grad_norm``) on the
        reduced gradients, its optional non-finite gradient check, then ``dk.step()`` (step, zero_grad, param
        mode's averaging when due)."""
        if self._forward is None:
            return
        strategy = self.dk._strategy
        if self.max_grad_norm and strategy.grads_in_params:
            strategy.wait_for_gradients(self._forward, self.optimizer)
            _clip_first_group(self.optimizer.param_groups[0]["params"], float(self.max_grad_norm))
        if self.skip_nonfinite_grads:
            self.check_gradients()
        self.dk.step()
        self.optimizer_step += 1
        faults.maybe_fire(self.dk.rank, self.dk.num_steps)  # DISTKIT_FAULT (tests: a rank killed after step N)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """SpeechBrain's, through the engine's optimizer once set up (an epoch's start and end)."""
        if self._forward is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            super().zero_grad(set_to_none)

    def _should_save_intra_epoch_ckpt(self, last_ckpt_time: float, steps_since_ckpt: int) -> bool:
        """SpeechBrain's decision, rank 0's (broadcast through the engine: the ranks' clocks differ)."""
        if self.checkpointer is None or (self.ckpt_interval_minutes <= 0 and self.ckpt_interval_steps <= 0):
            return False
        import time

        decision = 0 < self.ckpt_interval_minutes < (time.time() - last_ckpt_time) / 60.0
        decision = decision or 0 < self.ckpt_interval_steps <= steps_since_ckpt
        return bool(self.dk.broadcast_object(decision, 0)) if self.dk.world_size > 1 else decision

    def _save_intra_epoch_ckpt(self) -> None:
        with self._replicas.block():  # param mode: the checkpoint's model files hold the mean of the replicas
            super()._save_intra_epoch_ckpt()

    def _fit_valid(self, valid_set: Any, epoch: Any, enable: bool) -> None:
        with self._replicas.block():  # param mode: validation (and its on_stage_end checkpoint) on one model
            super()._fit_valid(valid_set, epoch, enable)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        with self._replicas.block():
            return super().evaluate(*args, **kwargs)

    def fit(self, *args: Any, **kwargs: Any) -> None:
        """SpeechBrain's ``fit``, then in param mode the final sync (collective): every rank holds one model."""
        distkit_errors_first()  # (an experiment directory made after the Brain)
        super().fit(*args, **kwargs)
        if self._forward is not None and self.dk._strategy.averager is not None and not self._replicas.finished:
            self.dk.finish()
            self._replicas.finished = True

    # -- every rank's own state in the recipe's Checkpointer --------------------------------------------------------
    def _save_rank_state(self, path: Any) -> None:
        """The ``distkit`` recoverable's save hook (every rank: SpeechBrain calls save hooks on all of them):
        ``dk.save`` of every rank's model and optimizer state (param mode: its own replica, its averager)."""
        if self._forward is None:
            return
        with self._replicas.own():
            self.dk.save(str(path), {"model": self._forward, "optimizer": self.optimizer})

    def _load_rank_state(self, path: Any, end_of_epoch: bool = True) -> None:
        """The ``distkit`` recoverable's load hook: restores every rank's state when ``fit`` resumes (collective);
        ``evaluate``'s recovery keeps the checkpoint's model files (one model: the mean in param mode)."""
        if self._forward is None or not self._resuming or not os.path.isdir(str(path)):
            return
        self.dk.load(str(path), {"model": self._forward, "optimizer": self.optimizer})  # (its RNG states too)
        if not end_of_epoch:  # mid-epoch: the random streams as they were at this batch, once the epoch's loader
            self._rng_at_batch = _rng_state()  # iterator is made (which draws a seed from torch's stream)

    def _fit_train(self, train_set: Any, epoch: Any, enable: bool) -> None:
        """SpeechBrain's; after a mid-epoch resume the random streams (dropout) are the checkpoint's from the
        first batch on, as in the run that was stopped."""
        state, self._rng_at_batch = self._rng_at_batch, None
        super()._fit_train(_StreamsAfterIter(train_set, state) if state is not None else train_set, epoch, enable)


def _refusal(text: str) -> UnsupportedCombination:
    """A Brain's refusal, raised by every rank at the same point (from the same run options and recipe, or agreed
    by a collective): marked agreed, so that rank 0 prints its one line and the ranks leave together with exit 2,
    where an error of one rank would abort the others (MPI_Abort under mpirun: Open MPI's banner and no line)."""
    error = UnsupportedCombination(text)
    error.agreed = True
    return error


def _rng_state() -> tuple[Any, Any, Any]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


class _StreamsAfterIter:
    """A loader whose iterator, once made, leaves torch's, Python's and numpy's random streams at ``state``."""

    def __init__(self, loader: Any, state: tuple[Any, Any, Any]) -> None:
        self.loader, self.state = loader, state

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        torch.set_rng_state(self.state[0])
        random.setstate(self.state[1])
        np.random.set_state(self.state[2])
        return it


def _clip_first_group(params: list[torch.Tensor], max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)`` as SpeechBrain's DDP computes it, bit for bit on every
    engine: the norm of whole gradients in the group's order. Sharded gradients (FSDP's DTensors) are gathered
    for the norm (collective; one whole gradient at a time in memory): a norm summed shard by shard rounds
    differently, and Adam carries the difference on. Each shard is then scaled by the same coefficient."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # (torch's own, in _clip_grads_with_norm_)
    with torch.no_grad():
        torch._foreach_mul_([p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params],
                            coefficient)


def _save_optimizer(optimizer: Any, path: Any) -> None:
    """SpeechBrain's ``torch_save`` of an optimizer (rank 0 writes), for the engine's optimizer object."""
    if _sbdist.if_main_process():
        torch.save(optimizer.state_dict(), str(path))


def _load_optimizer(optimizer: Any, path: Any, end_of_epoch: bool = True) -> None:
    optimizer.load_state_dict(torch.load(str(path), map_location="cpu", weights_only=True))


def _whole_saver(brain: Brain, prefix: str) -> Callable[[Any, Any], None]:
    def save(obj: Any, path: Any) -> None:
        dk = brain.dk
        # Collective: every rank gathers (SpeechBrain calls save hooks on all of them). In param mode the replicas
        # differ between syncs, so the file holds their mean (the block SpeechBrain's saves already run in, or
        # this one): dk.state_dict() refuses while they differ (it cannot know a block holds one model), so the
        # engine's gather is called as dk.state_dict() calls it.
        with brain._replicas.block(), dk._collective("the checkpoint's module files (dk.state_dict())"):
            whole, _, _ = dk._strategy.portable_state(dk._model, None, lambda name: True)
        if dk.is_main:
            torch.save({k[len(prefix):]: v.detach().cpu() for k, v in whole.items() if k.startswith(prefix)},
                       str(path))
    return save


def _whole_loader(brain: Brain, prefix: str) -> Callable[[Any, Any, bool], None]:
    def load(obj: Any, path: Any, end_of_epoch: bool = True) -> None:
        if brain._resuming:
            return  # the distkit recoverable restores every rank's state
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        whole = torch.load(str(path), map_location="cpu", weights_only=True)
        set_model_state_dict(brain.dk.unwrap(), {prefix + k: v for k, v in whole.items()},
                             options=StateDictOptions(full_state_dict=True, strict=False))
    return load


def __getattr__(name: str) -> Any:
    """SpeechBrain's namespace (``sb.Stage``, ``sb.dataio``, ``sb.utils``, ``sb.nnet`` ...)."""
    return getattr(_sb, name)
