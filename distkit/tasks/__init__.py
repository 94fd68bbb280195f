"""Built-in tasks: a model factory, train/eval datasets and a loss, all deterministic.

A task is what a config names with ``task = "digits"``. User tasks give the same three
pieces through the ``model``, ``dataset`` and ``loss`` keys instead.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Optional

from .base import Task, accuracy, cross_entropy  # noqa: F401 (the package's public names)

if TYPE_CHECKING:
    from distkit.config import RunConfig
    from distkit.errors import ConfigError


def _digits(cfg: "RunConfig") -> Task:
    from .digits import build

    return build(cfg)


def _charlm(cfg: "RunConfig") -> Task:
    from .charlm import build

    return build(cfg)


TASKS: dict[str, Callable[["RunConfig"], Task]] = {"digits": _digits, "charlm": _charlm}


def check_task(cfg: "RunConfig") -> None:
    """Before anything starts: the built-in task named by ``cfg`` exists (unless ``model`` and ``dataset`` are given)."""
    from distkit.config.resolve import choice
    from distkit.errors import ConfigError

    if cfg.model is not None and (cfg.dataset is not None or cfg.train_dataset is not None):
        return
    if cfg.task is None:
        raise ConfigError("no task: set task = 'digits' (or 'charlm'), or give 'model' and 'dataset' (or 'train_dataset')")
    choice("task", cfg.task, tuple(TASKS))
    from .charlm import CORPORA, SIZES

    choice("charlm_size", cfg.charlm_size, tuple(SIZES))
    choice("charlm_corpus", cfg.charlm_corpus, tuple(CORPORA))


def _factory_error(key: str, exc: Exception) -> "ConfigError":
    """ConfigError for the config's ``key`` factory that raised ``exc``: one line with the error and where
    in the user's code it was raised (the innermost frame), instead of a traceback per rank."""
    import traceback

    from distkit.errors import ConfigError

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if len(frames) > 1 else ""
    return ConfigError(f"the '{key}' factory raised {type(exc).__name__}: {exc}{where}: fix the factory in the config")


def _call_factory(key: str, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``factory(*args, **kwargs)``; an exception from it (other than a DistkitError, which already says
    what to do) is a ConfigError naming ``key`` (exit status 2).

    Collective under a Session of several ranks (every rank builds its model and datasets at the same
    point): the ranks agree on whether any call failed (one object all-gather), and every rank raises the
    first failing rank's error marked ``agreed``, so it is reported once, by rank 0, instead of once per
    rank plus the launcher's line; and a rank whose call succeeded does not wait for the failed one in
    the next collective."""
    from distkit.errors import DistkitError

    result: Any = None
    error: Optional["ConfigError"] = None
    try:
        result = factory(*args, **kwargs)
    except DistkitError:
        raise
    except Exception as e:  # the user's code: any error in it is a problem of the config
        error = _factory_error(key, e)
    _agree(error)
    return result


def _agree(error: Optional["ConfigError"]) -> None:
    """Raise ``error``; under a Session of several ranks, raise on every rank the first rank's error, if
    any rank has one (collective: see :func:`_call_factory`)."""
    from distkit import main_process
    from distkit.errors import ConfigError

    # the running Session's engine (set while a Session is open); not distkit.session.Session.current:
    # tasks sit below the session in the layers (DESIGN.md 2a) and must not import it
    strategy = main_process._CURRENT
    if strategy is None or strategy.world_size <= 1:
        if error is not None:
            raise error
        return
    texts = strategy.all_gather_object(None if error is None else str(error))
    failed = [(rank, text) for rank, text in enumerate(texts) if text is not None]
    if not failed:
        return
    rank, text = failed[0]
    if len(failed) < len(texts):  # not a mistake every rank makes: say where it happened
        text = f"{text} (on rank{'s' if len(failed) > 1 else ''} {', '.join(str(r) for r, _ in failed)})"
    agreed = ConfigError(text)
    agreed.agreed = True
    raise agreed


def _guarded(key: str, factory: Callable[..., Any]) -> Callable[..., Any]:
    """``factory`` whose exceptions become a ConfigError naming ``key`` (see :func:`_call_factory`). Each
    call is collective under a Session of several ranks: the training run calls ``task.model_fn()`` once
    on every rank, right after :func:`make_task`; a caller that builds the model on some ranks only must
    call the config's ``model`` itself."""
    @functools.wraps(factory)
    def call(*args: Any, **kwargs: Any) -> Any:
        return _call_factory(key, factory, *args, **kwargs)
    return call


def _dataset(key: str, value: Any) -> Any:
    """A dataset given as itself or as a factory (``key``: the config key, named if the factory raises)."""
    return _call_factory(key, value) if callable(value) and not hasattr(value, "__getitem__") else value


def make_task(cfg: "RunConfig") -> Task:
    """The built-in task, or the user's ``model`` with ``dataset`` (or ``train_dataset``/``eval_dataset``).

    ``dataset()`` returns a train dataset or a ``(train, eval)`` pair of map-style datasets. Items
    may be ``(inputs, targets)`` (with ``loss``, default cross-entropy) or any structure a
    ``train_step`` or the Hugging Face convention (dict batches, ``model(**batch).loss``) handles.
    A custom task reports only the metrics it is given (``metrics``): no accuracy for a regression.
    The dataset factories are called here, the ``model`` factory by whoever calls ``task.model_fn``; an
    exception from any of them is a ConfigError naming the key (one line, exit status 2).
    """
    if cfg.model is not None and (cfg.dataset is not None or cfg.train_dataset is not None):
        if cfg.train_dataset is not None:
            train, evl = _dataset("train_dataset", cfg.train_dataset), _dataset("eval_dataset", cfg.eval_dataset)
        else:
            data = _call_factory("dataset", cfg.dataset)
            train, evl = data if isinstance(data, tuple) else (data, None)
        task = Task("custom", _guarded("model", cfg.model), train, evl, cfg.loss or cross_entropy, metrics={})
    else:
        task = TASKS[str(cfg.task)](cfg)
        if cfg.model is not None:
            task.model_fn = _guarded("model", cfg.model)
        if cfg.loss is not None:
            task.loss = cfg.loss
    task.hf_loss = cfg.loss is None  # dict batches without a configured loss: model(**batch).loss
    if cfg.metrics is not None:
        task.metrics = {m if isinstance(m, str) else getattr(m, "__name__", f"metric{i}"): accuracy if m == "accuracy" else m
                        for i, m in enumerate(cfg.metrics)}
    task.train_step, task.eval_step = cfg.train_step, cfg.eval_step or cfg.train_step
    task.collate_fn = cfg.collate_fn or task.collate_fn
    return task
