"""The run's records beside the trackers' own (distkit's Trainer, :mod:`distkit.trainer`, writes and reads them): the
param-mode keys of a metrics record, the records an earlier run logged (metrics.jsonl), and the Trainer's one-line
reports (the hosts' ranks, a fault-tolerant sync whose groups changed). Pure functions of what they are given:
no collective, nothing written."""
from __future__ import annotations

import json
from typing import Any, Optional


def sync_record(counts: dict[str, int], mark: dict[str, int]) -> dict[str, Any]:
    """A metrics record's param-mode keys (rank 0's): ``sync_bytes`` and ``syncs``, the bytes this rank handed to the
    syncs' collectives and the sync events since the run started (a resume continues both from its checkpoint), and
    ``bytes_per_sync``, the bytes per sync since the previous record (``mark``, the counts then): None where no sync
    happened since."""
    syncs, sent = counts["syncs"] - mark["syncs"], counts["sync_bytes"] - mark["sync_bytes"]
    return {"sync_bytes": counts["sync_bytes"], "syncs": counts["syncs"],
            "bytes_per_sync": sent / syncs if syncs > 0 else None}


def logged_records(path: str) -> list[dict[str, Any]]:
    """The records with a ``step`` in the metrics.jsonl at ``path``, in order (none: no such file); a torn last line
    (the earlier run killed mid-write) is passed over."""
    records = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                    if isinstance(record, dict) and isinstance(record.get("step"), int):
                        records.append(record)
                except ValueError:
                    continue
    except OSError:
        return []
    return records


def sync_line(sync: dict[str, Any], group: int, before: Optional[list[int]]) -> str:
    """The line of a sync across fault-tolerant groups whose groups or outcome changed, naming the groups: which
    took part, which joined or left since the last such line (``before``: the members then), whom this group
    healed from."""
    members = sync["members"]  # a healing group is a member that takes no part in this sync's average
    line = f"distkit: sync at step {sync['step']}: " + (
        f"{_groups_named(members)} ({sync['groups']} averaged)" if members else f"{sync['groups']} group(s)")
    changes = []
    if before is not None and members:
        joined = [g for g in members if g not in before and g != group]
        left = [g for g in before if g not in members]
        changes += [f"{_groups_named(joined)} joined"] if joined else []
        changes += [f"{_groups_named(left)} left"] if left else []
    if sync["healed"]:
        src = sync.get("healed_from") or []
        changes.append(f"group {group} (this one) healed from {_groups_named(src) if src else 'a live group'}")
    if not sync["committed"]:
        changes.append(f"not committed ({sync.get('gave_up') or 'a group failed in it'})")
    return line + (": " + "; ".join(changes) if changes else "")


def _groups_named(groups: list[int]) -> str:
    """``group 2`` or ``groups 0, 1``."""
    return f"group{'s' if len(groups) > 1 else ''} {', '.join(map(str, groups))}"


def ranks_by_host(hosts: list[str], node_ranks: list[int]) -> str:
    """``"h0: ranks 0-3; h1: ranks 4-7"``: each host (in node order) and its ranks, consecutive ones as a range."""
    parts = []
    for node, host in enumerate(hosts):
        ranks = [r for r, n in enumerate(node_ranks) if n == node]
        runs: list[list[int]] = []  # [first, last] of each run of consecutive ranks
        for r in ranks:
            if runs and runs[-1][1] == r - 1:
                runs[-1][1] = r
            else:
                runs.append([r, r])
        spans = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
        parts.append(f"{host}: rank{'s' if len(ranks) != 1 else ''} {spans}")
    return "; ".join(parts)
