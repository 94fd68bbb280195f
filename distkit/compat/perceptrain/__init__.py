"""perceptrain's ``TrainConfig`` / ``Trainer`` / ``optimize_step`` on distkit (docs/perceptrain.md).

Change the two perceptrain imports of a script and it runs on distkit's engines::

    from distkit.compat.perceptrain import TrainConfig, Trainer          # was: from perceptrain import ...
    from distkit.compat.perceptrain.optimize_step import optimize_step   # was: from perceptrain.optimize_step import ...

``TrainConfig(backend="gloo"|"nccl")`` runs DDP on that torch.distributed backend,
``backend="mpi"`` distkit's mpi4py engine; ``TrainConfig(distributed={...})`` picks any engine
and mode (``{"backend": "horovod"}``, ``{"reduce_type": "param", "param_sync_step": 10}``, ...).
"""
from distkit.compat.perceptrain import optimize_step
from distkit.compat.perceptrain.config import TrainConfig
from distkit.compat.perceptrain.loss import cross_entropy_loss, get_loss, mse_loss
from distkit.compat.perceptrain.trainer import Trainer

__all__ = ["TrainConfig", "Trainer", "cross_entropy_loss", "get_loss", "mse_loss", "optimize_step"]
