"""What the bridges whose framework evaluates and checkpoints *one* model share: param mode's replica mean while
the ranks' replicas differ, and the user's random streams kept across :func:`distkit.init`.

Used by :mod:`distkit.integrations.hf_trainer` (``DistkitTrainer``) and :mod:`distkit.integrations.speechbrain`
(``distkit.speechbrain.Brain``). Imports no framework.
"""
from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator, Optional

import numpy as np
import torch

from distkit.session import Session


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """torch's, Python's and numpy's RNG as they were before: ``distkit.init`` seeds them with distkit's ``seed``,
    and the framework's own seeding (the Trainer's ``set_seed(args.seed)``, a SpeechBrain recipe's
    ``seed_everything`` in its hparams) must stay what dropout and sampling draw from."""
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])


class ReplicaMean:
    """Param mode's one model for evaluation and checkpoint files: inside :meth:`block`, while the ranks' replicas
    differ, every rank holds the mean of the replicas (parameters and floating buffers, the tensors a sync
    averages, plainly: no outer step); after it each rank's own replica again, and training goes on from there as
    if nothing had happened. A no-op in grad mode, on one rank, right after a sync, and after :meth:`finished`.

    Cross-rank contract: :meth:`block` is collective when it averages (the sync schedule, and so the answer of
    "do the replicas differ", is the same on every rank); :meth:`own` is not, except on DeepSpeed inside a block
    (the weights are rewritten from the fp32 masters: an all-gather), where every rank calls it (a save's).
    """

    def __init__(self, dk: Session) -> None:
        self.dk = dk
        #: dk.finish() ran (the end of training: every rank holds the same model from then on)
        self.finished = False
        self._own: Optional[list[torch.Tensor]] = None  # this rank's replica while a block holds the mean

    def _differing(self) -> Optional[Any]:
        """The averager, where the ranks' replicas differ now; else None (the same answer on every rank)."""
        dk = self.dk
        averager = dk._strategy.averager if dk._model is not None else None
        if averager is None or self.finished or dk.world_size == 1 or averager.in_sync():
            return None
        return averager

    @contextlib.contextmanager
    def block(self) -> Iterator[None]:
        """Collective while the replicas differ: the mean of the replicas inside (a nested block averages nothing
        again)."""
        averager = self._differing()
        if averager is None or self._own is not None:
            yield
            return
        self._own = [t.detach().clone() for t in averager.tensors]  # one copy of the model, for the block's length
        self.dk._strategy.average_parameters(averager.tensors, [averager.is_parameter(i) for i in range(len(self._own))])
        # where the averaged tensors are copies of the weights (DeepSpeed's fp32 masters), the weights from them: else
        # the forward would still see this rank's own replica (ZeRO-2: validation and the checkpoint's files rank 0's)
        averager._updated()
        try:
            yield
        finally:
            own, self._own = self._own, None
            with torch.no_grad():
                for t, mine in zip(averager.tensors, own, strict=True):
                    t.copy_(mine)
            averager._updated()

    @contextlib.contextmanager
    def own(self) -> Iterator[None]:
        """This rank's own replica inside (e.g. to save it per rank from within a :meth:`block`), the block's mean
        again after it. Not collective but on DeepSpeed (see the class); a no-op outside a block."""
        if self._own is None:
            yield
            return
        averager = self.dk._strategy.averager
        mean = [t.detach().clone() for t in averager.tensors]
        with torch.no_grad():
            for t, mine in zip(averager.tensors, self._own, strict=True):
                t.copy_(mine)
        averager._updated()  # (the weights from the tensors, as in block)
        try:
            yield
        finally:
            with torch.no_grad():
                for t, m in zip(averager.tensors, mean, strict=True):
                    t.copy_(m)
            averager._updated()
