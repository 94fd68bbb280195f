"""The Session's checkpoint methods (:meth:`distkit.Session.save`, ``save_async``, ``load``), a mixin of
:class:`distkit.Session`: what they write and restore is :mod:`distkit.checkpoint.save` and
:mod:`distkit.checkpoint.load`; here are the calls and the stall clock (``checkpoint_stalls_s``). And the model a
script keeps at the end, whole on every engine (:meth:`~Checkpoints.state_dict`, :meth:`~Checkpoints.save_pretrained`)."""
from __future__ import annotations

import os
import time
from typing import Any, Optional

import torch
from torch import nn

from distkit.errors import OutputError, UsageError

from .load import load_state
from .save import save_state
from .write import PendingCheckpoint, agree_on_error


class Checkpoints:
    """Mixin: the checkpoint methods of :class:`distkit.Session`, which holds the attributes below."""

    #: per checkpoint, in order: seconds this process was blocked in save (or save_async + commit)
    checkpoint_stalls_s: list[float]
    num_steps: int
    num_samples: int
    _strategy: Any
    _model: Optional[nn.Module]
    rank: int
    is_main: bool

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
            return save_state(self, path, state, background=False).commit()
        finally:
            self.checkpoint_stalls_s.append(time.perf_counter() - t0)

    def save_async(self, path: str, state: dict[str, Any]) -> PendingCheckpoint:
        """Collective: start writing ``state`` as checkpoint ``path`` (as :meth:`save`) and return as soon
        as the state is copied aside in CPU memory (and, on DeepSpeed, the engine's own files are written);
        training may go on while a background thread writes the files. ``pending.commit()`` (collective,
        every rank, e.g. before the next save) waits for them and completes the checkpoint, returning its
        path; until then it does not exist (a kill leaves the previous ones). Memory: one more copy of
        this rank's checkpoint state until the files are written."""
        t0 = time.perf_counter()
        pending = save_state(self, path, state, background=True)
        self.checkpoint_stalls_s.append(time.perf_counter() - t0)
        index = len(self.checkpoint_stalls_s) - 1

        def count_commit(seconds: float) -> None:  # waiting for the files is this checkpoint's stall too
            self.checkpoint_stalls_s[index] += seconds

        pending.on_commit = count_commit
        return pending

    @property
    def global_batch(self) -> Optional[int]:
        """Training samples per optimizer step, all ranks together (None before the first step)."""
        return self.num_samples // self.num_steps if self.num_steps else None

    def load(self, path: str, state: dict[str, Any]) -> dict[str, Any]:
        """Collective: restore ``state``'s objects in place from checkpoint ``path`` (the set-up model,
        optimizer and scheduler, and anything with ``load_state_dict``), plus distkit's counters,
        averager and RNG states. Returns the checkpoint's other entries (e.g. ``{"epoch": 3}``).

        This rank's file is verified against the manifest (size, sha256) first; a checkpoint written by
        another number of ranks, or whose parameter shapes do not fit the set-up model, raises
        ConfigError naming both before anything is restored."""
        extra = load_state(self, path, state)  # type: ignore[arg-type]
        # a restored scheduler's position is distkit's (Session.step's check_scheduler_steps)
        self._scheduler_mark = getattr(self._scheduler, "last_epoch", None)  # type: ignore[attr-defined]
        return extra

    # -- the whole model, at the end of a script ----------------------------------------------------
    def state_dict(self, model: Optional[nn.Module] = None) -> dict[str, torch.Tensor]:
        """Collective: the whole model's ``state_dict`` (the set-up model's by default), every tensor whole and on
        the CPU, on every rank and every engine: what ``dk.unwrap(model).state_dict()`` is under ddp. Under ZeRO-3
        and fsdp the bare module holds this rank's parts only (its own ``state_dict`` has partitions, or tensors
        of shape ``(0,)``): this gathers them (memory: one whole copy of the model per rank). Each rank's own
        persistent buffers (BatchNorm statistics), as under ddp: :meth:`finish` makes them rank 0's. In param mode
        the ranks' models differ until they sync: UsageError on every rank unless the last step synced (call
        :meth:`finish` first)."""
        self._require_setup("dk.state_dict()")  # type: ignore[attr-defined]
        if self._strategy.averager is not None and not self._strategy.averager.in_sync():
            raise UsageError("dk.state_dict(): in param mode the ranks' models differ until they sync: call "
                             "dk.finish() first (the final sync), then take the state")
        with self._collective("dk.state_dict()"):  # type: ignore[attr-defined]
            sd, _, _ = self._strategy.portable_state(model if model is not None else self._model, None,
                                                     lambda name: True)
        return {k: v.detach().cpu() for k, v in sd.items()}

    def save_pretrained(self, model: Optional[nn.Module], path: str, **kwargs: Any) -> str:
        """Collective: a Hugging Face model's ``save_pretrained(path, **kwargs)`` (its config and safetensors),
        written by rank 0 from :meth:`state_dict`, so that ``from_pretrained(path)`` loads the trained model on
        every engine (ZeRO-3 and fsdp included, tied weights kept); the other ranks wait until it is written.
        Returns the absolute path. A model without ``save_pretrained`` is a UsageError on every rank; a failed
        write (a full disk) an OutputError on every rank, naming rank 0's cause. Param mode: as
        :meth:`state_dict` (after :meth:`finish`)."""
        bare = self.unwrap(model)  # type: ignore[attr-defined]
        if not callable(getattr(bare, "save_pretrained", None)):
            raise UsageError(f"dk.save_pretrained: {type(bare).__name__} has no save_pretrained (not a Hugging Face "
                             "model): save dk.state_dict(model) with torch.save or safetensors instead")
        sd = self.state_dict(model)
        failed: Optional[str] = None
        if self.is_main:
            try:
                bare.save_pretrained(path, state_dict=sd, **kwargs)
            except Exception as e:  # agreed below: no rank waits for rank 0's failure
                failed = f"dk.save_pretrained({path!r}): rank 0 could not write it ({type(e).__name__}: {str(e)[:300]})"
        agree_on_error(self._strategy, failed, OutputError)
        return os.path.abspath(path)
