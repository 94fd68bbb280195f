"""Small factories the training loop uses: the optimizer and the device."""
from __future__ import annotations

from typing import Any

import torch

from distkit.config import RunConfig

_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def build_optimizer(cfg: RunConfig, params: Any, world_size: int = 1) -> torch.optim.Optimizer:
    """The configured optimizer; ``distributed.scale_lr`` multiplies the learning rate by the world size."""
    kwargs = {k: v for k, v in cfg.optimizer.items() if k != "class"}
    lr = cfg.learning_rate * (world_size if cfg.distributed.scale_lr else 1)
    return _OPTIMIZERS[str(cfg.optimizer["class"]).lower()](params, lr=lr, **kwargs)


def pick_device(name: str, local_rank: int) -> torch.device:
    """``cuda:local_rank`` for "cuda" (or "auto" with CUDA visible), else the CPU."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)  # before any collective: DDP/NCCL use the current device
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
