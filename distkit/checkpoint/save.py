"""The Session's side of saving (:meth:`distkit.Session.save`, ``save_async``): what goes into each rank's
file and into the engine-neutral portable part, handed to :func:`~distkit.checkpoint.write.start`.

These functions are the Session's own checkpoint code, kept apart from its API: they read the
session's set-up objects and counters (``session._model``, ``_optimizer``, ``_strategy``) and never
change them."""
from __future__ import annotations

import contextlib
import math
import random
from typing import Any, Optional, Protocol

import numpy as np
import torch
from torch import nn

from distkit import portable
from distkit.backends.base import Strategy
from distkit.config import RunConfig
from distkit.errors import UsageError

from .manifest import model_shapes
from .write import PendingCheckpoint, start


class SessionView(Protocol):
    """What saving and loading (:mod:`.save`, :mod:`.load`) read and set of :class:`distkit.Session`, which has
    every member: typed by this protocol, the checkpoint package does not import the Session (it sits below it).
    """

    _given_optimizer: Any  # the optimizer the user passed to setup (the engine may hold another)
    _loss_watch: Any  # the non-finite loss guard (health.guards.LossWatch)
    _model: Optional[nn.Module]
    _optimizer: Any
    _strategy: Strategy
    cfg: RunConfig
    num_samples: int
    num_steps: int
    resumed_global_batch: Optional[int]
    run_id: Optional[str]

    def _collective(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Runs a collective, its timeout line naming ``what``."""

    @property
    def fault_tolerance(self) -> Any:
        """torchft's Manager of a fault-tolerant group, else None."""

    @property
    def global_batch(self) -> Optional[int]:
        """Training samples per optimizer step, all ranks together."""

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Print on rank 0."""

    @property
    def rank(self) -> int:
        """Global rank."""

    def unwrap(self, model: Optional[nn.Module] = None) -> nn.Module:
        """The plain module inside the engine's wrapper."""

    @property
    def world_size(self) -> int:
        """Ranks in the job."""


def engine_state(session: SessionView) -> dict[str, Any]:
    """The engine's own state of the set-up model and optimizer (param mode: each rank's replica)."""
    return session._strategy.state_dict(session._model, session._optimizer)  # type: ignore[arg-type]


def internal_state(session: SessionView) -> dict[str, Any]:
    """distkit's own part of a rank file: the averager, this rank's RNG states, the step and sample counters, and
    with fault-tolerant groups the torchft Manager's state (how many syncs committed: a resumed group that
    starts from it does not take the live groups for ahead of it and heal)."""
    averager = session._strategy.averager
    ft = session.fault_tolerance  # fault-tolerant groups: the torchft Manager's committed syncs (its "step")
    return {"averager": averager.state_dict() if averager is not None else None,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
            "progress": {"step": session.num_steps, "samples": session.num_samples},
            "fault_tolerance": ft.manager.state_dict() if ft is not None else None}


def save_state(session: SessionView, path: str, state: dict[str, Any], background: bool) -> PendingCheckpoint:
    """Collective: start writing ``state`` as checkpoint ``path`` (see :meth:`distkit.Session.save`); the
    files are written in a background thread with ``background``. ``pending.commit()`` completes it."""
    if not isinstance(state, dict):
        raise UsageError(f"dk.save(path, state): state must be a dict, got {type(state).__name__}")
    session._loss_watch.raise_if_bad(session.rank)  # CUDA: never save the model of a run whose loss already diverged
    # Grad mode: the replicas are equal, and the portable part holds them once, each tensor written
    # by one rank; the rank files then carry no model or optimizer (no rank gathers a ZeRO-3 model,
    # and the N copies are not written). Param mode: the replicas differ between syncs, each rank
    # file keeps its own (the portable part has rank 0's only).
    engine: dict[str, Any] = {}
    if session._model is not None:
        engine = (engine_state(session) if session.cfg.distributed.reduce_type == "param"
                  else {"model": None, "optimizer": None})
    out: dict[str, Any] = {}
    for key, value in state.items():
        if session._model is not None and value is session._model:
            out[key] = engine["model"]
        elif session._model is not None and value is session._optimizer:
            out[key] = engine["optimizer"]
        elif hasattr(value, "state_dict") and callable(value.state_dict):
            out[key] = value.state_dict()
        else:
            out[key] = value
    # the user's entries (the engine's state is distkit's own): what a load could not read without running code is
    # refused now, naming the entry, not found at the resume
    engine_keys = {k for k, v in state.items()
                   if session._model is not None and (v is session._model or v is session._optimizer)}
    portable.check_saveable({k: v for k, v in out.items() if k not in engine_keys})
    out["distkit"] = internal_state(session)
    # in the manifest: a resume checks them before anything is restored
    shapes = model_shapes(session.unwrap()) if session._model is not None else None
    return start(session._strategy, path, out, session._model, step=session.num_steps, shapes=shapes,
                            samples=session.num_samples, portable_part=portable_part(session, state, out),
                            global_batch=session.global_batch, background=background, run_id=session.run_id)


def portable_part(session: SessionView, state: dict[str, Any], out: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Collective (ZeRO): this rank's share of the engine-neutral state (see :mod:`distkit.portable`)
    and rank 0's ``meta``. In grad mode the tensors are dealt out to the ranks; in param mode the
    ranks differ between syncs and rank 0's replica is written."""
    model_key = next((k for k, v in state.items() if session._model is not None and v is session._model), None)
    opt_key = next((k for k, v in state.items() if session._optimizer is not None and v is session._optimizer), None)
    tensors: dict[str, torch.Tensor] = {}
    groups: list[dict[str, Any]] = []
    scalars: dict[str, dict[str, Any]] = {}
    if model_key is not None:
        sizes = {k: math.prod(v) for k, v in model_shapes(session.unwrap()).items()}
        # grad mode: the parameters are the same on every rank, dealt out; the buffers are not (BatchNorm's
        # statistics are each rank's own since its last forward): rank 0's, as a DDP script saves them and as
        # DDP gives every rank at its next forward
        params = {n for n, _ in session.unwrap().named_parameters()}
        owner = (portable.deal({k: v for k, v in sizes.items() if k in params}, session.world_size)
                 if session.cfg.distributed.reduce_type == "grad" else {})
        sd, optim_state, groups = session._strategy.portable_state(
            session._model, session._optimizer if opt_key else None,  # type: ignore[arg-type]
            lambda name: owner.get(name, 0) == session.rank)
        tensors, scalars = portable.flatten(sd, optim_state)
        if session.world_size > 1:  # optimizer values that are not tensors live in rank 0's meta
            for part in session._strategy.all_gather_object(scalars):
                scalars.update(part)
    averager, averager_counters = session._strategy.averager, None
    if averager is not None:  # param mode: the same on every rank; rank 0 writes it
        averager_tensors, averager_counters = averager.portable_state(keep=session.rank == 0)  # collective under ZeRO
        tensors.update({f"{portable.AVERAGER}/{k}": v for k, v in averager_tensors.items()})
    meta = {"format": 1, "model_key": model_key, "optimizer_key": opt_key, "optim_groups": groups,
            "optim_scalars": scalars, "engine": session._strategy.name, "world_size": session.world_size,
            "reduce_type": session.cfg.distributed.reduce_type,
            "progress": {"step": session.num_steps, "samples": session.num_samples, "global_batch": session.global_batch},
            "averager": averager_counters, "entries": {k: v for k, v in out.items() if k not in (model_key, opt_key, "distkit")}}
    hf = getattr(session.unwrap(), "config", None) if model_key is not None else None
    if hf is not None and callable(getattr(hf, "to_dict", None)):  # a Hugging Face model: for `distkit export DIR/`
        meta["hf_config"] = {**hf.to_dict(), "architectures": [type(session.unwrap()).__name__]}
    return tensors, meta
