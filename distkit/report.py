"""The run's summary (:meth:`distkit.Session.summary`, the keys of ``summary.json``): what every rank measured,
and whether the ranks hold the same model state. The Session's own report code, kept apart from its
API: it reads the session's counters and model and changes nothing."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from distkit.backends.parts import persistent_buffers, whole
from distkit.evaluation import param_checksum

if TYPE_CHECKING:
    from distkit.session import Session


def alone_syncs(syncs: list[dict[str, Any]], num_replicas: int) -> dict[str, int]:
    """``alone_syncs``: the committed syncs this group made with no other group (of ``num_replicas`` > 1), and
    ``last_syncs_alone``: how many of the last syncs in a row were so. After one of those, this group's model
    is not the other groups' (they ended, failed or never started): the run's last line says so."""
    if num_replicas <= 1:
        return {"alone_syncs": 0, "last_syncs_alone": 0}
    alone = [x["committed"] and x["groups"] == 1 and not x["healed"] for x in syncs]
    trailing = 0
    for was_alone in reversed(alone):
        if not was_alone:
            break
        trailing += 1
    return {"alone_syncs": sum(alone), "last_syncs_alone": trailing}


def summary(session: "Session", **extra: Any) -> dict[str, Any]:
    """Collective: see :meth:`distkit.Session.summary`."""
    session._require_setup("summary()")
    s, d = session._strategy, session.cfg.distributed
    wall = time.perf_counter() - session._t_start
    loss = None
    if session._last_loss is not None:
        loss = float(session.all_reduce(session._last_loss.float().reshape(1).cpu().clone(), op="mean"))
    params = list(s.full_named_parameters(session._model))  # type: ignore[arg-type]
    checksum = param_checksum(params)
    # In sync means the whole model state: parameters and persistent buffers (BatchNorm statistics).
    buffers = [(f"buffer.{i}", b) for i, b in enumerate(persistent_buffers(session.unwrap()))]
    # ... and every module registered with keep_in_sync (an EMA copy)
    # (whole: a sharded copy's DTensors gathered, a collective every rank runs in the same order)
    kept = [(f"kept.{i}.{n}", whole(t)) for i, m in enumerate(session._kept) for n, t in m.state_dict().items()
            if torch.is_tensor(t)]
    state = param_checksum(params + buffers + kept) if buffers or kept else checksum
    with session._collective("the checksum exchange of dk.summary()"):
        in_sync = all(c == state for c in s.all_gather_object(state))
    out = {
        "backend": d.backend, "backend_impl": s.backend_impl(), "reduce_type": d.reduce_type,
        "param_sync_step": d.param_sync_step if d.reduce_type == "param" else None,
        "param_sync_group_size": d.param_sync_group_size if d.reduce_type == "param" else None,
        "world_size": session.world_size, **session.topology(), "launcher": session.env.launcher,
        "zero_stage": getattr(s, "zero_stage", None),
        "steps": session.num_steps, "samples": session.num_samples, "final_train_loss": loss,
        "eval_loss": None, "eval_accuracy": None, "best_eval_loss": None, "best_eval_step": None,
        "param_checksum": checksum, "ranks_in_sync": in_sync,
        "wall_time_s": wall, "setup_time_s": session._setup_time_s,
        "checkpoints": len(session.checkpoint_stalls_s), "checkpoint_stall_s": sum(session.checkpoint_stalls_s),
        "checkpoint_stalls_s": [round(t, 6) for t in session.checkpoint_stalls_s],
        "total_time_s": time.perf_counter() - session._t_created, "samples_per_s": session.num_samples / max(wall, 1e-9),
        "compute_fraction": session.compute_time_s / max(wall, 1e-9), "comm_wait_s": session.comm_wait_s,
        "comm_bytes": s.comm_bytes,
        "stopped_early": False, "run_id": session.run_id,
    }
    ft = session.fault_tolerance
    if ft is not None:  # fault-tolerant replica groups: this group, and every change of the groups in the syncs
        out["fault_tolerance"] = {"replica_id": ft.replica_id, "num_replicas": ft.num_replicas, "syncs": len(ft.syncs),
                                  "committed": sum(x["committed"] for x in ft.syncs), "heals": ft.heals,
                                  "manager_step": ft.manager.current_step(),
                                  "membership": ft.membership_changes(), "wait_s": ft.wait_s,
                                  **alone_syncs(ft.syncs, ft.num_replicas)}
    out.update(extra)
    return out
