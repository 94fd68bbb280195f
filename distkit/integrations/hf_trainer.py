"""``distkit.hf.DistkitTrainer``: a ``transformers.Trainer`` whose training runs through a distkit Session.

A subclass, not a callback: a callback sees the bare model after the optimizer step (``on_step_end``), so it could
average parameters on top of Accelerate's DDP, whose gradient all-reduce would still run every step (that is not
param mode); and it cannot route backward, the optimizer step or the per-rank checkpoint state through distkit. The
subclass replaces exactly the seams the Trainer has for this: ``_wrap_model`` (a model that is not ``self.model``
is not DDP-wrapped by Accelerate), ``accelerator.backward``, the optimizer's ``step``, ``_save_checkpoint`` and
``_load_optimizer_and_scheduler``. A script changes one import (``from distkit.hf import DistkitTrainer as
Trainer``) and passes ``distkit=`` its config (grad mode with no config: the Trainer's own DDP run).

Imported by :mod:`distkit.hf` on first use of ``DistkitTrainer`` (transformers takes seconds to import).
"""
from __future__ import annotations

import contextlib
import os
import random
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch import nn

import distkit
from distkit.config.arguments import Source, config_from
from distkit.errors import BackendUnavailable, UnsupportedCombination
from distkit.integrations.session_optimizer import SessionOptimizer

try:
    from transformers import Trainer
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError:
    raise BackendUnavailable("distkit.hf.DistkitTrainer needs transformers: pip install 'distkit[hf]' "
                             "(accelerate>=1.10, transformers>=4.46)") from None

#: the sub-directory of a Trainer checkpoint that holds distkit's per-rank state (param mode)
STATE_DIR = "distkit"


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


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """torch's, Python's and numpy's RNG as they were before: ``distkit.init`` seeds them with distkit's ``seed``,
    and the Trainer's own ``set_seed(args.seed)`` (its constructor) must stay what dropout and sampling draw from."""
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])


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

    Cross-rank contract: as the Trainer's: every rank constructs it (collective: ``distkit.init``), calls
    ``train`` and saves checkpoints (collective in param mode); ``train`` ends with ``dk.finish()`` (param mode:
    the final average, so ``save_model`` writes the model every rank holds).
    """

    def __init__(self, *args: Any, distkit: Source = None, **kwargs: Any) -> None:  # noqa: A002 - the config's name
        super().__init__(*args, **kwargs)
        cfg, _ = config_from(distkit)
        d = cfg.distributed
        if d.backend != "ddp":
            raise UnsupportedCombination(
                f"DistkitTrainer runs distkit's ddp engine (grad or param mode), not {d.backend!r}: for DeepSpeed or "
                "FSDP use the Trainer's own (TrainingArguments(deepspeed=..., fsdp=...)); for mpi/horovod distkit's "
                "own loop or distkit train")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or self.args.fp16:
            raise UnsupportedCombination("DistkitTrainer replaces the Trainer's DDP: remove deepspeed/fsdp/fp16 from "
                                         "TrainingArguments (bf16 is fine), or use transformers.Trainer for them")
        if cfg.explicit_keys is not None and "output_dir" not in cfg.explicit_keys:  # (None: a RunConfig, as given)
            cfg.output_dir = os.path.join(self.args.output_dir, STATE_DIR)  # the Session's files with the run's
        with _rng_kept():
            self.dk = _init(cfg)

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
        wrapped, optimizer = self.dk.setup(self.accelerator.unwrap_model(model), self.optimizer)
        self.optimizer = SessionOptimizer(optimizer, self.dk)  # (Accelerate prepares it next)
        return _SessionModule(wrapped, self.dk)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``, then ``dk.finish()`` (collective; param mode: the final sync)."""
        out = super().train(*args, **kwargs)
        if self.dk._model is not None:
            self.dk.finish()
        return out

    def _state_path(self, checkpoint: str) -> str:
        return os.path.join(checkpoint, STATE_DIR)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint (rank 0's model and optimizer, each rank's RNG), then in param mode, where ranks
        differ between syncs, every rank's own state (collective: ``dk.save``)."""
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


def _init(cfg: Any) -> Any:
    """``distkit.init`` (a function of its own: the constructor's ``distkit`` argument shadows the module)."""
    return distkit.init(cfg)
