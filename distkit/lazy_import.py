"""Defer a module that a library imports at import time but rarely uses until its first use.

DeepSpeed's ``deepspeed.autotuning.autotuner`` runs ``import mlflow`` whenever ``import deepspeed`` runs
(``deepspeed.runtime.config`` imports the autotuner), only to log autotuning experiments. Where MLflow is
installed that costs 0.7-0.8 s of CPU per process on this 2-core machine (mlflow pulls in protobuf,
opentelemetry, fastapi, ...), in every DeepSpeed rank of every run, three quarters of DeepSpeed's own import.
:func:`defer` puts a module object in ``sys.modules`` whose code runs on the first access of any attribute
other than its name, file and spec (:data:`_METADATA`): an ``import mlflow`` statement finds it and only reads
``__spec__`` (the import system's "is it still initialising" check), so the library's import costs nothing; the first real use
(``mlflow.start_run``, ``from mlflow import ...``, ``import mlflow.tracking``, distkit's own MLflow tracker)
loads the whole module, once, into the same object, exactly as a plain import would have. Unlike
:class:`importlib.util.LazyLoader`, whose module loads on *any* attribute access, ``__spec__`` included
(which every later ``import`` statement reads, so it loads at once).
"""
from __future__ import annotations

import importlib.util
import sys
import threading
import types
from typing import Any

_lock = threading.RLock()  # two threads touching the module first: one loads it, the other waits


#: what is read of every module in ``sys.modules`` without using it, answered without running its code: the
#: import system reads ``__spec__`` (its "still initialising" check) at every ``import`` statement, and
#: ``inspect.getmodule`` reads ``__file__`` of every module (torch.library does, when DeepSpeed registers its ops),
#: ``isinstance`` reads ``__class__``.
#: Not ``__path__``: importing a submodule reads it, and the package's code must run first.
_METADATA = frozenset({"__spec__", "__name__", "__file__", "__loader__", "__package__", "__cached__", "__class__"})


class _Deferred(types.ModuleType):
    """A module whose code has not run yet; becomes a plain module on its first use."""

    def __getattribute__(self, attr: str) -> Any:
        if attr in _METADATA:
            return types.ModuleType.__getattribute__(self, attr)
        with _lock:
            if type(self) is _Deferred:  # not loaded by another thread meanwhile
                # a plain module again before its code runs: the code's own imports of submodules read
                # the package's __path__, which must not come back here
                self.__class__ = types.ModuleType
                spec = types.ModuleType.__getattribute__(self, "__dict__")["__spec__"]
                try:
                    spec.loader.exec_module(self)
                except BaseException:
                    sys.modules.pop(spec.name, None)  # as a failed plain import leaves it: not imported
                    raise
        return getattr(self, attr)


def defer(name: str) -> None:
    """Put ``name`` (a top-level module) in ``sys.modules`` unloaded, its code to run on first use.

    Does nothing when it is already imported or not installed (``import name`` then raises as usual)."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return
    module = importlib.util.module_from_spec(spec)
    module.__class__ = _Deferred
    sys.modules[name] = module
