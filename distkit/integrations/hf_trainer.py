"""``distkit.hf.DistkitTrainer``: a ``transformers.Trainer`` whose training runs through a distkit Session.

A subclass, not a callback: a callback sees the bare model after the optimizer step (``on_step_end``), so it could
average parameters on top of Accelerate's DDP, whose gradient all-reduce would still run every step (that is not
param mode); and it cannot route backward, the optimizer step or the per-rank checkpoint state through distkit. The
subclass replaces exactly the seams the Trainer has for this: ``_wrap_model`` (a model that is not ``self.model``
is not DDP-wrapped by Accelerate), ``accelerator.backward``, the optimizer's ``step``, ``_save_checkpoint`` and
``_load_optimizer_and_scheduler``. A script changes one import (``from distkit.hf import DistkitTrainer as
Trainer``) and passes ``distkit=`` its config (grad mode with no config: the Trainer's own DDP run).

Param mode's ranks hold different replicas between syncs; the Trainer evaluates and checkpoints one model. So
evaluation (``evaluation_loop``: ``evaluate``, ``predict``) and the checkpoint's model files see the mean of the
replicas while they differ (each rank's own replica is put back afterwards, and training goes on from it): a
``best_metric`` is the metric of the model ``checkpoint-N`` holds, and ``load_best_model_at_end`` loads that one
model on every rank.

Imported by :mod:`distkit.hf` on first use of ``DistkitTrainer`` (transformers takes seconds to import).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch
from torch import nn

import distkit
from distkit.config.arguments import Source, config_from
from distkit.errors import BackendUnavailable, UnsupportedCombination
from distkit.health.guards import install_excepthook
from distkit.integrations.hf import refuse_mpirun_without_rendezvous
from distkit.integrations.replicas import ReplicaMean, rng_kept
from distkit.integrations.session_optimizer import SessionOptimizer
from distkit.session import Session

refuse_mpirun_without_rendezvous()  # (imported directly, not through distkit.hf: the same check)

try:
    from transformers import Trainer
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError:
    raise BackendUnavailable("distkit.hf.DistkitTrainer needs transformers: pip install 'distkit[hf]' "
                             "(accelerate>=1.10, transformers>=4.46)") from None

#: the sub-directory of a Trainer checkpoint that holds distkit's per-rank state (param mode)
STATE_DIR = "distkit"
#: per engine DistkitTrainer does not run: what to use instead (the refusal's fix)
_OTHER_ENGINES = {
    "deepspeed": "transformers.Trainer with TrainingArguments(deepspeed=...)",
    "fsdp": "transformers.Trainer with TrainingArguments(fsdp=...)",
    "mpi": "distkit's own loop (distkit.init) or distkit train",
    "horovod": "distkit's own loop (distkit.init) or distkit train",
}


class _SessionModule(nn.Module):
    """The set-up model (DDP in grad mode, the bare model in param mode) as the Trainer trains it: a module other
    than ``trainer.model``, so Accelerate does not wrap it again, whose ``no_sync`` is the Session's."""

    def __init__(self, inner: nn.Module, dk: Any) -> None:
        super().__init__()
        self.inner = inner
        self._dk = dk

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return self._dk.no_sync()  # type: ignore[no-any-return]


class DistkitTrainer(Trainer):
    """``transformers.Trainer`` on distkit: ``DistkitTrainer(model, args, ..., distkit=config)``.

    ``distkit``: distkit's config (a dict, config file path(s), an ``argparse.Namespace`` from
    :func:`distkit.add_arguments` with ``++key value`` pairs, or a RunConfig), e.g. ``{"distributed":
    {"reduce_type": "param", "param_sync_step": 8}, "param_outer_optimizer": {...}}``. The ddp engine, grad or param
    mode (param mode's extras: outer optimizer, fragments, compression, overlap), launched by ``torchrun`` /
    ``accelerate launch`` (distkit's Session adopts the process group Accelerate initialised). Gradient
    accumulation is the Trainer's (``gradient_accumulation_steps``); clipping the Trainer's (``max_grad_norm``).
    Checkpoints: the Trainer's own, plus in param mode each rank's model, optimizer and averager state in
    ``checkpoint-N/distkit`` (``dk.save``), which ``train(resume_from_checkpoint=...)`` restores.

    Cross-rank contract: as the Trainer's: every rank constructs it (collective: ``distkit.init``; a refusal comes
    before it and before the Trainer's constructor, alike on every rank: one line, exit 2, nothing written), calls
    ``train``, evaluates (collective, as the Trainer's evaluation; in param mode during training it also averages
    the replicas) and saves checkpoints (collective in param mode); ``train`` ends with ``dk.finish()`` (param mode:
    the final average, so ``save_model`` writes the model every rank holds), which ``load_best_model_at_end`` runs
    before it loads the best checkpoint's one model on every rank.
    """

    def __init__(self, *args: Any, distkit: Source = None, **kwargs: Any) -> None:  # noqa: A002 - the config's name
        # distkit.init installs the hook that makes a DistkitError one line and exit 2; the refusals below come
        # before it (and before the Trainer's constructor, which creates the output directory): install it here
        install_excepthook(lambda: Session.current)
        cfg, _ = config_from(distkit)
        _refuse(cfg, kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:  # (set by accelerate launch's config, not the args)
            raise UnsupportedCombination("DistkitTrainer replaces the Trainer's DDP: launch without Accelerate's "
                                         "deepspeed/fsdp config, or use transformers.Trainer for them")
        if cfg.explicit_keys is not None and "output_dir" not in cfg.explicit_keys:  # (None: a RunConfig, as given)
            cfg.output_dir = os.path.join(self.args.output_dir, STATE_DIR)  # the Session's files with the run's
        with rng_kept():
            self.dk = _init(cfg)
        self._replicas = ReplicaMean(self.dk)  # evaluation and the checkpoint's model files: one model

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's Accelerator (it initialises the process group distkit's Session adopts), whose ``backward``
        (a plain ``loss.backward()`` at the Trainer's settings: accumulation 1, no fp16 scaler) becomes the
        engine's, ``dk.backward`` (collective in grad mode outside ``no_sync``). Also after a re-creation."""
        super().create_accelerator_and_postprocess()
        self.accelerator.backward = self._distkit_backward  # type: ignore[method-assign]

    def _distkit_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.dk.backward(loss)

    @property
    def param_mode(self) -> bool:
        return self.dk.cfg.distributed.reduce_type == "param"  # type: ignore[no-any-return]

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """Training: collective on the first call: ``dk.setup`` (rank 0's weights everywhere; DDP in grad mode, the
        averager in param mode) on the bare model and the Trainer's optimizer; evaluation: the Trainer's own."""
        if not training or isinstance(model, _SessionModule):
            return model if training else super()._wrap_model(model, training, dataloader)
        if self.dk._model is not None:
            raise UnsupportedCombination("DistkitTrainer trains one model per process (one distkit Session): build a "
                                         "new process for another train() with model_init or another model")
        self.dk.set_accumulation(self.args.gradient_accumulation_steps)
        # what accelerator.prepare does to the model apart from placing and DDP-wrapping it (the Session does):
        # mixed precision's autocast around forward (bf16=True), and the model registered as the Accelerator's.
        # Without it training ran in float32, and the Trainer's first evaluation, finding no prepared model,
        # prepared it there: autocast from then on, and an eval_model_preparation_time metric in every evaluation
        bare = self.accelerator.prepare_model(self.accelerator.unwrap_model(model), device_placement=False,
                                              evaluation_mode=True)
        wrapped, optimizer = self.dk.setup(bare, self.optimizer)
        self.optimizer = SessionOptimizer(optimizer, self.dk)  # (Accelerate prepares it next)
        return _SessionModule(wrapped, self.dk)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``, then ``dk.finish()`` (collective; param mode: the final sync) unless
        ``load_best_model_at_end`` ran it already."""
        out = super().train(*args, **kwargs)
        self._finish()
        return out

    def _finish(self) -> None:
        """Collective, once: ``dk.finish()`` when the Session trained a model."""
        if self.dk._model is not None and not self._replicas.finished:
            self.dk.finish()
            self._replicas.finished = True

    def _load_best_model(self) -> None:
        """Collective: the training's final sync first, then the Trainer's load of the best checkpoint (the same
        file on every rank: one model). After the load the final sync would take the loaded model for local
        progress (with an outer optimizer it would step away from it)."""
        self._finish()
        super()._load_best_model()

    def _one_model(self) -> contextlib.AbstractContextManager[None]:
        """Collective in param mode while the replicas differ: every rank holds the mean of the replicas inside
        the block (:class:`~distkit.integrations.replicas.ReplicaMean`), its own replica after it."""
        return self._replicas.block()

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's (``evaluate``, ``predict``) on one model: in param mode during training the mean of the
        replicas (collective, as the Trainer's evaluation is), which is also what a checkpoint of this step holds."""
        with self._one_model():
            return super().evaluation_loop(*args, **kwargs)

    def _state_path(self, checkpoint: str) -> str:
        return os.path.join(checkpoint, STATE_DIR)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint, then in param mode, where ranks differ between syncs, every rank's own state
        (collective: ``dk.save``). The Trainer's model files hold the mean of the replicas (the model this step's
        evaluation saw; rank 0 writes it): what ``load_best_model_at_end`` and ``from_pretrained`` load; a resume
        restores each rank's own replica from ``checkpoint-N/distkit``."""
        with self._one_model():
            super()._save_checkpoint(model, trial)
        if self.param_mode and self.dk._model is not None:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            self.dk.save(self._state_path(folder), {"model": self.dk.model, "optimizer": self.dk.optimizer})

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        """The Trainer's, then (collective) this rank's own model, optimizer and averager state where the
        checkpoint has them (it runs after ``_wrap_model``: the Session's set-up broadcast is behind)."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.param_mode and os.path.isdir(self._state_path(checkpoint)):
            self.dk.load(self._state_path(checkpoint), {"model": self.dk.model, "optimizer": self.dk.optimizer})


def _refuse(cfg: Any, args: Any) -> None:
    """Not collective (every rank decides alike from the same config and arguments): what DistkitTrainer does
    not run, before anything is built or written (UnsupportedCombination: one line, exit 2)."""
    engine = cfg.distributed.backend
    if engine != "ddp":
        fix = _OTHER_ENGINES.get(engine, "another trainer")
        raise UnsupportedCombination(f"DistkitTrainer runs distkit's ddp engine (grad or param mode), not {engine!r}: "
                                     f"remove distributed.backend, or use {fix}")
    # (fp16: the Trainer's GradScaler would step the optimizer itself, around distkit's step)
    for name, works, what in (("deepspeed", "", "DeepSpeed"), ("fsdp", "", "FSDP"),
                              ("fp16", " (bf16=True works)", "fp16")):
        if args is not None and getattr(args, name, None):
            raise UnsupportedCombination(f"DistkitTrainer replaces the Trainer's DDP and optimizer step: remove {name} "
                                         f"from TrainingArguments{works}, or use transformers.Trainer for {what}")


def _init(cfg: Any) -> Any:
    """``distkit.init`` (a function of its own: the constructor's ``distkit`` argument shadows the module)."""
    return distkit.init(cfg)
