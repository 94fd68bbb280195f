"""The documented path of the SpeechBrain bridge: ``import distkit.speechbrain as sb`` in place of ``import
speechbrain as sb`` (SpeechBrain's namespace, with ``sb.Brain`` training on distkit's engines and modes), or
``class MyBrain(distkit.speechbrain.Brain)``. The code is :mod:`distkit.integrations.speechbrain`. Importing this
module imports SpeechBrain and takes distkit's flags (``--nprocs``, ``--config``, ``++key value``) out of
``sys.argv``."""
from typing import Any

from distkit.integrations import speechbrain as _bridge
from distkit.integrations.speechbrain import Brain, ddp_init_group, join, parse_arguments

__all__ = ["Brain", "ddp_init_group", "join", "parse_arguments"]


def __getattr__(name: str) -> Any:
    """SpeechBrain's namespace (``sb.Stage``, ``sb.dataio``, ``sb.utils``, ``sb.nnet`` ...)."""
    return getattr(_bridge, name)
