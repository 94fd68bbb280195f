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
from typing import Any, Callable

_lock = threading.RLock()  # two threads touching the module first: one loads it, the other waits


#: what is read of every module in ``sys.modules`` without using it, answered without running its code: the
#: import system reads ``__spec__`` (its "still initialising" check) at every ``import`` statement, and
#: ``inspect.getmodule`` reads ``__file__`` of every module (torch.library does, when DeepSpeed registers its ops),
#: ``isinstance`` reads ``__class__``.
#: Not ``__path__``: importing a submodule reads it, and the package's code must run first.
_METADATA = frozenset({"__spec__", "__name__", "__file__", "__loader__", "__package__", "__cached__", "__class__"})


#: deferred module -> {attribute: what it answers while the module's code has not run} (:func:`defer_dynamo`)
_STAND_INS: dict[str, dict[str, Any]] = {}
#: deferred module -> what runs just before its code does
_BEFORE_LOAD: dict[str, Callable[[], None]] = {}


class _Deferred(types.ModuleType):
    """A module whose code has not run yet; becomes a plain module on its first use."""

    def __getattribute__(self, attr: str) -> Any:
        if attr in _METADATA:
            return types.ModuleType.__getattribute__(self, attr)
        name = types.ModuleType.__getattribute__(self, "__name__")
        stand_in = _STAND_INS.get(name, {}).get(attr)
        if stand_in is not None and type(self) is _Deferred:
            return stand_in
        with _lock:
            if type(self) is _Deferred:  # not loaded by another thread meanwhile
                # a plain module again before its code runs: the code's own imports of submodules read
                # the package's __path__, which must not come back here
                self.__class__ = types.ModuleType
                spec = types.ModuleType.__getattribute__(self, "__dict__")["__spec__"]
                before = _BEFORE_LOAD.pop(name, None)
                if before is not None:
                    before()
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


def load(name: str) -> None:
    """Import ``name`` for real: run a deferred module's code now (else a plain import)."""
    module = importlib.import_module(name)
    if type(module) is _Deferred:
        module.__doc__  # noqa: B018 - any attribute outside _METADATA and the stand-ins runs its code


def _graph_break(msg: str = "") -> None:
    """``torch._dynamo.graph_break`` while dynamo is not loaded: nothing is being compiled, so nothing to break (the
    real function's body is empty too; dynamo acts on the call only while it traces, and it traces only once
    loaded)."""


class _TraceRules:
    """``torch._dynamo.trace_rules`` while dynamo is not loaded: ``init_process_group`` calls its
    ``clear_lru_cache()`` whenever ``torch._dynamo`` is in ``sys.modules``, to drop rules cached before
    torch.distributed was imported; a dynamo not loaded has cached none. Any other name loads dynamo and is read
    from the real module."""

    @staticmethod
    def clear_lru_cache() -> None:
        """Nothing cached yet."""

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("torch._dynamo.trace_rules"), name)


#: ``torch.optim.Optimizer`` methods wrapped in ``torch._disable_dynamo``, whose first call imports dynamo
_OPTIMIZER_DISABLED = ("zero_grad", "state_dict", "load_state_dict", "add_param_group")


def defer_dynamo() -> None:
    """Defer ``torch._dynamo`` (1.2-1.4 s of CPU per process on this 2-core machine, a third of a rank's start)
    until something compiles, in a process that has imported torch but not dynamo yet.

    Eager training imports it anyway without using it: every ``torch.optim`` step runs ``import torch._dynamo`` and
    calls ``torch._dynamo.graph_break()`` (a no-op outside tracing), and ``Optimizer.zero_grad``, ``state_dict``,
    ``load_state_dict`` and ``add_param_group`` are wrapped in ``torch._disable_dynamo``, which imports it at their
    first call to build the "run without dynamo" wrapper; ``init_process_group`` clears dynamo's rule caches
    when it is imported. Deferred, the module answers ``graph_break`` with a no-op and ``trace_rules`` with
    :class:`_TraceRules` (its ``clear_lru_cache`` a no-op: nothing cached), and those four methods are marked as
    already disabled (``fn.__dynamo_disable = fn``: the wrapper then calls the method itself, which is what the
    disabled version does outside tracing). Any other use of ``torch._dynamo``
    (``torch.compile``, ``torch._dynamo.config``, DDP's constructor, ``import torch._dynamo.utils``) loads it: the
    marks are removed first, so the methods are disabled for real by the time anything can trace. Does nothing
    where dynamo is already imported (a config or script that imported it, the launcher's preimport)."""
    torch = sys.modules.get("torch")
    if torch is None or "torch._dynamo" in sys.modules:
        return
    spec = importlib.util.find_spec("torch._dynamo")
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return
    marked = []
    for method in _OPTIMIZER_DISABLED:
        fn = getattr(getattr(torch.optim.Optimizer, method, None), "__wrapped__", None)
        if fn is not None and "__dynamo_disable" not in vars(fn):
            setattr(fn, "__dynamo_disable", fn)
            marked.append(fn)

    def unmark() -> None:
        for fn in marked:
            if vars(fn).get("__dynamo_disable") is fn:
                delattr(fn, "__dynamo_disable")

    module = importlib.util.module_from_spec(spec)
    _STAND_INS[spec.name] = {"graph_break": _graph_break, "trace_rules": _TraceRules()}
    _BEFORE_LOAD[spec.name] = unmark
    module.__class__ = _Deferred
    sys.modules[spec.name] = module
    torch._dynamo = module  # what `import torch._dynamo` then `torch._dynamo.x` reads (set by a real import)
