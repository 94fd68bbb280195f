"""distkit: one PyTorch training job on DDP, DeepSpeed ZeRO, Horovod or MPI, in grad or param mode."""
from distkit.config import LaunchFlags, RunConfig, load_config
from distkit.env import ClusterEnv, detect
from distkit.errors import (
    BackendUnavailable, CheckpointError, CollectiveTimeout, ConfigError, DistkitError, RankFailure,
    RankLost, RankStalled, UnsupportedCombination, UsageError,
)
from distkit.main_process import is_main_process, run_on_main
from distkit.session import Session, add_arguments, init
from distkit.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable", "CheckpointError", "ClusterEnv", "CollectiveTimeout", "ConfigError", "DistkitError",
    "LaunchFlags", "RankFailure", "RankLost", "RankStalled", "RunConfig", "Session", "Trainer",
    "UnsupportedCombination", "UsageError",
    "add_arguments", "detect", "init", "is_main_process", "load_config", "run_on_main",
]
