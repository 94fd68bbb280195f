"""The documented path of the Hugging Face bridges (``from distkit.hf import ParamSync``, ``DistkitTrainer``): the
code is :mod:`distkit.integrations.hf` (Accelerate) and :mod:`distkit.integrations.hf_trainer` (``transformers.Trainer``).
Importing this module imports Accelerate; ``DistkitTrainer`` imports transformers on first use."""
from typing import Any

from distkit.integrations.hf import ParamSync, param_config

__all__ = ["ParamSync", "DistkitTrainer", "param_config"]


def __getattr__(name: str) -> Any:
    if name == "DistkitTrainer":  # transformers takes seconds to import: not for a script of Accelerate alone
        from distkit.integrations.hf_trainer import DistkitTrainer

        return DistkitTrainer
    raise AttributeError(f"module 'distkit.hf' has no attribute {name!r}")
