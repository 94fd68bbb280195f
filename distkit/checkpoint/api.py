"""The Session's checkpoint methods (:meth:`distkit.Session.save`, ``save_async``, ``load``), a mixin of
:class:`distkit.Session`: what they write and restore is :mod:`distkit.checkpoint.save` and
:mod:`distkit.checkpoint.load`; here are the calls and the stall clock (``checkpoint_stalls_s``)."""
from __future__ import annotations

import time
from typing import Any, Optional

from .load import load_state
from .save import save_state
from .write import PendingCheckpoint


class Checkpoints:
    """Mixin: the checkpoint methods of :class:`distkit.Session`, which holds the attributes below."""

    #: per checkpoint, in order: seconds this process was blocked in save (or save_async + commit)
    checkpoint_stalls_s: list[float]
    num_steps: int
    num_samples: int

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
        return load_state(self, path, state)
