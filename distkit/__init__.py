"""distkit: one PyTorch training job on DDP, DeepSpeed ZeRO, Horovod or MPI, in grad or param mode."""
from distkit.config import LaunchFlags, RunConfig, load_config
from distkit.env import ClusterEnv, detect
from distkit.errors import (
    BackendUnavailable, CollectiveTimeout, ConfigError, DistkitError, RankFailure, UnsupportedCombination,
)
from distkit.main_process import is_main_process, run_on_main
from distkit.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable", "ClusterEnv", "CollectiveTimeout", "ConfigError", "DistkitError", "LaunchFlags",
    "RankFailure", "RunConfig", "Trainer", "UnsupportedCombination", "detect", "is_main_process",
    "load_config", "run_on_main",
]
