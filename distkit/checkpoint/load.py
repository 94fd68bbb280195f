"""The Session's side of loading (:meth:`distkit.Session.load`): a checkpoint of the same layout is restored
from each rank's file and the engine's own files; one of another engine, world size, mode or ZeRO
stage from its portable part (:mod:`distkit.portable`).

These functions are the Session's own checkpoint code, kept apart from its API: they restore into
the session's set-up objects and set its counters (``num_steps``, ``num_samples``,
``resumed_global_batch``)."""
from __future__ import annotations

import os
import random
from typing import Any, Optional

import numpy as np
import torch

from distkit import portable
from distkit.errors import CheckpointError, UsageError

from .manifest import check_fits, model_shapes, read_manifest, read_rank_file, verify
from .save import SessionView


def load_state(session: SessionView, path: str, state: dict[str, Any]) -> dict[str, Any]:
    """Collective: restore ``state``'s objects in place from checkpoint ``path`` (the set-up model,
    optimizer and scheduler, and anything with ``load_state_dict``), plus distkit's counters,
    averager and RNG states. Returns the checkpoint's other entries (e.g. ``{"epoch": 3}``).

    This rank's file is verified against the manifest (size, sha256) first; a checkpoint written by
    another number of ranks, or whose parameter shapes do not fit the set-up model, raises
    ConfigError naming both before anything is restored."""
    if not isinstance(state, dict):
        raise UsageError(f"dk.load(path, state): state must be a dict, got {type(state).__name__}")
    if session._model is not None:
        check_fits(path, session.world_size, lambda: model_shapes(session.unwrap()))
    manifest = read_manifest(path)
    if not same_layout(session, manifest):
        return load_portable(session, path, manifest, state)
    session.resumed_global_batch = manifest.get("global_batch")
    saved = read_rank_file(path, session.rank, session.world_size)
    if "distkit" not in saved and "progress" in saved:  # written before the Session existed (0.1.0)
        saved["distkit"] = {k: saved.pop(k) for k in ("averager", "rng", "progress")}
    model_key = next((k for k, v in state.items() if v is session._model and v is not None), None)
    opt_key = next((k for k, v in state.items() if v is session._optimizer and v is not None), None)
    if model_key is not None:
        session._strategy.load_engine_files(path, session._model)  # type: ignore[arg-type]
        if saved.get(model_key) is None and not session._strategy.engine_files:
            # grad mode: the rank files hold no replica; the portable part has it (exactly: fp32 as trained)
            restore_portable(session, read_portable(path), opt_key)
        else:
            engine = {"model": saved.get(model_key), "optimizer": saved.get(opt_key) if opt_key else None}
            session._strategy.load_state_dict(session._model, session._optimizer, engine)  # type: ignore[arg-type]
    rest = {}
    for key, value in saved.items():
        if key in (model_key, opt_key, "distkit"):
            continue
        target = state.get(key)
        if target is not None and hasattr(target, "load_state_dict") and callable(target.load_state_dict):
            target.load_state_dict(value)
        else:
            rest[key] = value
    internal = saved["distkit"]
    if session._strategy.averager is not None and internal.get("averager") is not None:
        session._strategy.averager.load_state_dict(internal["averager"])
    if session.fault_tolerance is not None and internal.get("fault_tolerance"):
        session.fault_tolerance.manager.load_state_dict(internal["fault_tolerance"])
    torch.set_rng_state(internal["rng"]["torch"])
    random.setstate(internal["rng"]["python"])
    np.random.set_state(internal["rng"]["numpy"])
    session.num_steps, session.num_samples = internal["progress"]["step"], internal["progress"]["samples"]
    relink_given_optimizer(session)
    return rest


def relink_given_optimizer(session: SessionView) -> None:
    """After a load: where the engine returned its own optimizer object over the user's param groups
    (Horovod), ``load_state_dict`` gave it new group dicts; a scheduler (or script) holding the user's
    optimizer must keep setting the learning rate the engine steps with, so the user's object shares them."""
    given, opt = session._given_optimizer, session._optimizer
    if (isinstance(given, torch.optim.Optimizer) and isinstance(opt, torch.optim.Optimizer) and given is not opt
            and given.param_groups is not opt.param_groups):
        given.param_groups = opt.param_groups
        given.state = opt.state


def read_portable(path: str) -> dict[str, Any]:
    """The portable part of checkpoint ``path``, verified against the manifest first."""
    problem = verify(path, under=portable.DIR)
    if problem:
        raise CheckpointError(f"checkpoint '{path}' is damaged: {problem}; resume from another checkpoint "
                              "(++resume auto falls back to the newest complete one)")
    return portable.read(path)


def restore_portable(session: SessionView, entries: dict[str, Any], opt_key: Optional[str]) -> None:
    """Collective (ZeRO): the set-up model, and the optimizer when ``opt_key`` names it and the
    checkpoint holds one, from a checkpoint's portable ``entries``."""
    meta = entries[portable.META]
    with session._collective("loading the checkpoint's portable part"):
        session._strategy.load_portable_state(
            session._model, session._optimizer if opt_key and meta["optimizer_key"] else None,  # type: ignore[arg-type]
            portable.model_state(entries), portable.optimizer_state(entries), meta["optim_groups"])


def same_layout(session: SessionView, manifest: dict[str, Any]) -> bool:
    """Whether checkpoint ``manifest`` was written by this engine, mode, ZeRO stage and number of
    ranks (then each rank's own file and the engine's files restore it exactly)."""
    d = session.cfg.distributed
    return (manifest["world_size"] == session.world_size and manifest.get("engine") in (None, session._strategy.name)
            and manifest.get("reduce_type") in (None, d.reduce_type)
            and manifest.get("zero_stage") == getattr(session._strategy, "zero_stage", None))


def load_portable(session: SessionView, path: str, manifest: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """Restore ``state`` from the portable part of a checkpoint another engine, world size, mode or
    ZeRO stage wrote (see :mod:`distkit.portable`); RNG states come from the rank of the same
    number when the writer had one. Param mode's averager continues the writer's period (steps since
    the last sync, the outer optimizer's anchor and momentum) when the writer was in param mode too,
    else it starts a new period from the loaded weights."""
    entries = read_portable(path)
    meta = entries[portable.META]
    model_key = next((k for k, v in state.items() if v is session._model and v is not None), None)
    opt_key = next((k for k, v in state.items() if v is session._optimizer and v is not None), None)
    if model_key is not None:
        restore_portable(session, entries, opt_key)
    rest = {}
    for key, value in meta["entries"].items():
        target = state.get(key)
        if target is not None and hasattr(target, "load_state_dict") and callable(target.load_state_dict):
            target.load_state_dict(value)
        else:
            rest[key] = value
    averager = session._strategy.averager
    if averager is not None and meta.get("averager") is not None:
        with session._collective("loading the averager's state from the checkpoint's portable part"):
            averager.load_portable_state(portable.averager_state(entries), meta["averager"])
    elif averager is not None:
        averager.restart()
    if os.path.isfile(os.path.join(path, f"rank-{session.rank:05d}.pt")):  # (a converted checkpoint has none)
        own = portable.load_file(os.path.join(path, f"rank-{session.rank:05d}.pt"), mmap=True)
        rng = (own.get("distkit") or own).get("rng")
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
    progress = meta["progress"]
    session.num_steps, session.num_samples = progress["step"], progress["samples"]
    session.resumed_global_batch = progress.get("global_batch")
    zs = manifest.get("zero_stage")
    was = f"{manifest.get('engine', '?')}{f' ZeRO-{zs}' if zs is not None else ''}"
    zs = getattr(session._strategy, "zero_stage", None)
    now = f"{session._strategy.name}{f' ZeRO-{zs}' if zs is not None else ''}"
    n, m = manifest["world_size"], session.world_size
    relink_given_optimizer(session)
    session.print(f"distkit: checkpoint {os.path.basename(path)} was written by {was} on {n} rank{'s' * (n != 1)} in "
               f"{manifest.get('reduce_type', '?')} mode; loaded its portable part into {now} on {m} rank{'s' * (m != 1)} "
               f"in {session.cfg.distributed.reduce_type} mode")
    return rest
