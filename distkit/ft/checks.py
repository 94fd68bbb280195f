"""The checks of a ``fault_tolerance`` dict made before anything starts (``distkit.config`` runs them while it
validates a config, so a bad dict is one line and exit 2): its keys and values, and that torchft imports. Imports
nothing of torch or of the rest of :mod:`distkit.ft`."""
from __future__ import annotations

import os
import urllib.parse
from typing import Any, Optional

from distkit.errors import BackendUnavailable, ConfigError
from distkit.ft import gate
from distkit.ft.lighthouse import INSTALL_HINT

#: default ``fault_tolerance.connect_timeout_s``: how long the members of a new quorum wait for each other to
#: connect (torchft's gloo group is rebuilt at every quorum change)
CONNECT_TIMEOUT_S = 30.0


def check_config(ft: dict[str, Any], reduce_type: str, sync_time_diff: Any, timeout_s: Any = None,
                 outer_optimizer: Any = None) -> None:
    """Raise ConfigError (exit 2) for a ``fault_tolerance`` dict that cannot work (``timeout_s``: the run's
    ``distributed.timeout_s``, which bounds ``connect_timeout_s``; ``outer_optimizer``: the run's
    ``distributed.outer_optimizer``). Not collective."""
    known = {"lighthouse", "replica_id", "num_replicas", "min_replicas", "quorum_timeout_s", "connect_timeout_s",
             "token_file", "late", "grace_s", "grace_fraction"}
    unknown = sorted(set(ft) - known)
    if unknown:
        raise ConfigError(f"fault_tolerance: unknown key(s) {', '.join(unknown)}: known are {', '.join(sorted(known))}")
    if reduce_type != "param":
        raise ConfigError("fault_tolerance averages across replica groups in param mode: set distributed.reduce_type "
                          "= 'param' (gradients are reduced inside each group every step)")
    if sync_time_diff is not None:
        raise ConfigError("fault_tolerance syncs by step (param_sync_step): remove param_sync_time_diff")
    lighthouse = ft.get("lighthouse")
    try:  # (a port above 65535 is a ValueError of urlparse: a traceback before)
        port = urllib.parse.urlparse(lighthouse).port if isinstance(lighthouse, str) else None
    except ValueError:
        port = None
    if not port:
        raise ConfigError(f"fault_tolerance.lighthouse must be the lighthouse's URL with a port from 1 to 65535, e.g. "
                          f"'http://HOST:29510' (`distkit lighthouse` prints it), got {lighthouse!r}")
    if ft.get("token_file") is not None and not (isinstance(ft["token_file"], str) and ft["token_file"]):
        raise ConfigError(f"fault_tolerance.token_file must be the path of the lighthouse's token file (`distkit "
                          f"lighthouse` prints it), or None for a lighthouse without authentication, got "
                          f"{ft['token_file']!r}")
    for key, low in (("replica_id", 0), ("num_replicas", 1), ("min_replicas", 1)):
        value = ft.get(key, 1 if key == "min_replicas" else None)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"fault_tolerance.{key} must be an integer >= {low}, got {value!r}")
    if ft["replica_id"] >= ft["num_replicas"]:
        raise ConfigError(f"fault_tolerance.replica_id {ft['replica_id']} is not below num_replicas "
                          f"{ft['num_replicas']}: number the groups 0 .. num_replicas - 1")
    if ft.get("min_replicas", 1) > ft["num_replicas"]:
        raise ConfigError(f"fault_tolerance.min_replicas {ft['min_replicas']} is larger than num_replicas "
                          f"{ft['num_replicas']}, the groups that can ever join: no sync could commit")
    for key, default in (("quorum_timeout_s", 600), ("connect_timeout_s", CONNECT_TIMEOUT_S)):
        timeout = ft.get(key, default)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ConfigError(f"fault_tolerance.{key} must be a positive number of seconds, got {timeout!r}")
    late = ft.get("late", "heal")
    if late not in ("heal", "merge"):
        raise ConfigError(f"fault_tolerance.late must be 'heal' (a group left out of a sync heals at its next one: its "
                          f"steps since its last sync are replaced) or 'merge' (its pseudo-gradient is merged at the "
                          f"next sync it joins, weighted by its samples), got {late!r}")
    for key, number in (("grace_s", ft.get("grace_s", 0)), ("grace_fraction", ft.get("grace_fraction", 0))):
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number < float("inf"):
            unit = "seconds" if key == "grace_s" else "a fraction of the time since the group's last sync"
            raise ConfigError(f"fault_tolerance.{key} must be a number >= 0 ({unit}), got {number!r}")
    given = [key for key in ("grace_s", "grace_fraction") if key in ft]
    if given and late != "merge":
        raise ConfigError(f"fault_tolerance.{given[0]} is the grace window of late = 'merge' (with late = 'heal' it is "
                          f"the lighthouse's --join-timeout): set late = 'merge', or remove {given[0]}")
    if len(given) == 2:
        raise ConfigError("fault_tolerance.grace_s and grace_fraction are two ways to give one grace window: give one")
    if late == "merge" and outer_optimizer is not None:
        raise ConfigError("fault_tolerance.late = 'merge' averages the groups' pseudo-gradients itself, with plain "
                          "averaging only in this release: remove distributed.outer_optimizer, or set late = 'heal'")
    connect = ft.get("connect_timeout_s")
    if connect is not None and isinstance(timeout_s, (int, float)) and connect > timeout_s:
        # (the wait was cut to timeout_s unseen: the groups' collectives are bounded by it)
        raise ConfigError(f"fault_tolerance.connect_timeout_s ({connect:g}) is larger than distributed.timeout_s "
                          f"({timeout_s:g}), which bounds every wait of the groups: set connect_timeout_s to at most "
                          f"{timeout_s:g}, or raise distributed.timeout_s")


def token_of(ft: dict[str, Any]) -> Optional[bytes]:
    """The lighthouse's token for the groups of ``ft`` (:func:`distkit.ft.gate.read_token` of ``token_file``, the
    default file where the key is absent); None where ``token_file`` is None (a lighthouse without a gate: torchft's
    own). ConfigError, one line, where the file cannot serve. Not collective: every rank reads it."""
    if "token_file" in ft and ft["token_file"] is None:
        return None
    return gate.read_token(ft.get("token_file"))


def import_torchft() -> Any:
    """The torchft package, or BackendUnavailable with the install command.

    torchft's Rust side (each group's Manager server and client) logs every quorum and commit at INFO to stderr,
    about 1.3 KB per rank per sync; distkit reports the membership itself (summary, metrics.jsonl), so their
    default level here is warnings: ``RUST_LOG=info`` in the environment brings them back. Its logger reads
    ``RUST_LOG`` when the extension loads, so this is set before the import."""
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError as e:
        raise BackendUnavailable(f"fault_tolerance needs torchft ({e}): {INSTALL_HINT}") from None
    return torchft
