"""A fault-tolerant group's training state, as a live group serves it to one that heals and as that group takes
it (the Session's side of :mod:`distkit.ft.groups`, which knows the Session only as a type), and where a
group's ranks take their data."""
from __future__ import annotations

import hashlib
from typing import Any, Optional, Protocol

import torch
from torch import nn

from distkit.backends.base import Strategy
from distkit.config import RunConfig
from distkit.errors import HealMismatch


class SessionView(Protocol):
    """What this module reads (and sets) of :class:`distkit.Session`, which has every member: typed by this
    protocol, the module does not import the Session (it sits below it).
    """

    _model: Optional[nn.Module]
    _optimizer: Any
    _scheduler: Any
    _strategy: Strategy
    cfg: RunConfig
    num_samples: int
    num_steps: int


def training_state(session: SessionView) -> dict[str, Any]:
    """This rank's training state for the same rank of a group that heals (read while this rank waits in a sync:
    nothing changes it meanwhile). The engine-neutral form of the portable checkpoint part (model and optimizer
    state by name; on fsdp this rank's shards, :meth:`Strategy.heal_state`). Must not be collective (torchft asks
    one rank of a group at a time, from its quorum thread): DeepSpeed, whose ZeRO shards cannot be taken rank by
    rank, refuses fault_tolerance with more than one rank per group before start (its ``check_config``)."""
    s, scheduler = session._strategy, session._scheduler
    model, optim, groups = s.heal_state(session._model, session._optimizer)  # type: ignore[arg-type]
    state = {"model": model, "optimizer": optim, "groups": groups,
             "scheduler": scheduler.state_dict() if hasattr(scheduler, "state_dict") else None,
             "averager": s.averager.state_dict() if s.averager is not None else None,
             "distkit": {"num_steps": session.num_steps, "num_samples": session.num_samples},
             "world_size": s.world_size}
    state["digests"] = digests(state)
    return state


#: the parts of a training state whose restore a heal checks (the scheduler's state may hold functions)
CHECKED = ("model", "optimizer", "averager", "distkit")


def digests(state: dict[str, Any]) -> dict[str, str]:
    """sha256 of each :data:`CHECKED` part of a training state: every tensor's dtype, shape and bytes, every other
    value's repr, dict keys in sorted order."""
    out = {}
    for part in CHECKED:
        h = hashlib.sha256()

        def walk(x: Any) -> None:
            if torch.is_tensor(x):
                t = x.detach().cpu().contiguous().reshape(-1)
                h.update(f"{t.dtype}{tuple(x.shape)}".encode())
                h.update(t.view(torch.uint8).numpy().tobytes())
            elif isinstance(x, dict):
                for k in sorted(x, key=repr):
                    h.update(repr(k).encode())
                    walk(x[k])
            elif isinstance(x, (list, tuple)):
                h.update(b"[")
                for v in x:
                    walk(v)
                h.update(b"]")
            else:
                h.update(repr(x).encode())

        walk(state.get(part))
        out[part] = h.hexdigest()
    return out


def load_training_state(session: SessionView, state: dict[str, Any]) -> None:
    """Collective over this group: take a live group's state (:func:`training_state`); this group heals (inside
    a sync, before its result is applied; the step and sample counters jump to that group's).

    torchft picks each rank's source by its rank (rank ``r`` of the group heals from live group ``(k + r) mod
    live groups``), so with several live groups the ranks of this group receive different groups' states: the
    same model (every live group committed the same syncs), different optimizer states (each group's own local
    steps). Every rank takes rank 0's, so the group's ranks stay identical, as DDP keeps them; where each rank
    holds its own shards (fsdp, :attr:`Strategy.heals_rank_by_rank`) each takes its own, which needs the live
    group's ranks to hold the same shards: the same number of ranks (HealMismatch, one line, otherwise)."""
    s, scheduler = session._strategy, session._scheduler
    if s.heals_rank_by_rank and state.get("world_size", s.world_size) != s.world_size:
        raise HealMismatch(f"replica group {session.cfg.fault_tolerance['replica_id']} runs {s.world_size} ranks "  # type: ignore[index]
                           f"and a live group {state['world_size']}: backend '{s.name}' shards the model over a "
                           "group's ranks, so a group heals only from one with the same shards: start every group "
                           "with the same number of ranks")
    if s.world_size > 1 and not s.heals_rank_by_rank:  # every rank of a group heals at the same sync: all call this
        state = s.broadcast_object(state if s.rank == 0 else None, 0)
    s.load_heal_state(session._model, session._optimizer,  # type: ignore[arg-type]
                      (state["model"], state["optimizer"], state["groups"]))
    if state.get("scheduler") is not None and hasattr(scheduler, "load_state_dict"):
        scheduler.load_state_dict(state["scheduler"])
    if state.get("averager") is not None and s.averager is not None:
        s.averager.load_state_dict(state["averager"])
    session.num_steps, session.num_samples = int(state["distkit"]["num_steps"]), int(state["distkit"]["num_samples"])
    # what this group now holds must be what the live group sent, part by part: an engine that restored only part
    # of it would train on unseen (the next syncs average the models, not the optimizer states)
    held = training_state(session)["digests"]
    wrong = [part for part in CHECKED if held[part] != state["digests"][part]]
    if wrong:
        raise HealMismatch(f"rank {s.rank} of replica group {session.cfg.fault_tolerance['replica_id']} "  # type: ignore[index]
                           f"healed from a live group, but its {', '.join(wrong)} state differs from what that group "
                           f"sent (the {s.name} engine restored it only in part): report it; meanwhile run this "
                           "engine without fault_tolerance, or another engine inside the groups")


def data_place(ft: Optional[dict[str, Any]], rank: int, world_size: int) -> tuple[int, int]:
    """(rank, world size) this rank takes its data slices as: in group ``replica_id`` of ``num_replicas``,
    what rank ``replica_id * world_size + rank`` of one job of ``num_replicas * world_size`` ranks takes."""
    if not ft:
        return rank, world_size
    return int(ft["replica_id"]) * world_size + rank, int(ft["num_replicas"]) * world_size
