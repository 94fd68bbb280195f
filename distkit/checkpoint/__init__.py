"""Atomic, verified, resumable checkpoints (DESIGN.md section 6).

Layout under ``output_dir/checkpoints/``::

    step-0000040/rank-00000.pt ... rank-NNNNN.pt, manifest.json   (manifest written last)
    latest                                                         (text: "step-0000040")

Protocol (collective, every rank, :func:`write`): rank 0 makes a hidden temporary directory;
every rank writes its own file (``.part`` then rename) and hashes it; the ranks agree on
success (a failed write, e.g. a full disk, removes the partial files and raises on every
rank); rank 0 writes the manifest (each file's size and sha256, the model's parameter
shapes) and renames the directory to its final name; barrier; then rank 0 replaces
``latest`` by rename (:func:`mark_latest`), deletes leftovers of interrupted saves and keeps
the newest ``keep`` checkpoints. Re-saving an existing step moves the old directory aside
(``.step-N.old``) and deletes it only after the new one is in place; :func:`resolve` finds
the aside copy if a kill came in between. So ``latest`` always names a complete checkpoint.

Resuming (:func:`find_resumable`) verifies every file's size and sha256 and continues from the
newest complete checkpoint, saying so when ``latest`` names another (missing, damaged, not text,
naming an incomplete checkpoint, or stale: a newer one is complete); when checkpoints exist but
none is complete it raises, naming the damaged file. :func:`check_layout` refuses, at start,
a ``checkpoints`` that is a file or a ``latest`` that is a directory.

One run per ``output_dir`` (:func:`lock_output_dir`): the process owning the run holds an
``flock`` on ``output_dir/.distkit.lock`` to its end. :func:`write_json` writes the run's small
JSON files (``summary.json``, ``config.resolved.json``) atomically.

Each rank saves its own state (in param mode ranks differ between syncs, and RNG states always
do). Assumes ``output_dir`` is on a filesystem every rank sees (one node, or a shared FS).

The package, by module (each imports only those listed before it):

* :mod:`~distkit.checkpoint.paths`: names of the layout, sha256, full-disk detection;
* :mod:`~distkit.checkpoint.manifest`: reading: ``latest``, the manifest, verification, the
  checkpoint to resume from, fit checks, run ids, one rank's file;
* :mod:`~distkit.checkpoint.write`: the collective write protocol, ``latest``, clean-up;
* :mod:`~distkit.checkpoint.outputs`: the ``output_dir`` lock, atomic JSON files, the checks
  before any rank starts;
* :mod:`~distkit.checkpoint.save` and :mod:`~distkit.checkpoint.load`: the Session's two entries,
  :func:`save_state` and :func:`load_state`;
* :mod:`~distkit.checkpoint.api`: the Session's ``save``, ``save_async`` and ``load`` methods (a mixin).

The engine-neutral part (any engine, world size, mode) is :mod:`distkit.portable`, a public module
of its own (``distkit.portable.load_into``).
"""
from __future__ import annotations

from .load import load_state, read_portable
from .manifest import (
    TRUSTED_ENV, check_fits, check_layout, checkpoint_for, exists, find_resumable, fitting_checkpoint, latest, model_shapes,
    new_run_id, read_latest, read_manifest, read_rank_file, recorded_run_id, resolve, run_id_note, verify,
)
from .outputs import (
    LOCK_ENV, LOCK_NAME, check_output_dir, holds_lock, lock_output_dir, open_own, preflight, refuse_if_in_use,
    unlock_output_dir, write_json,
)
from .paths import KEEP, STEP_RE, sha256_file, step_name
from .save import save_state
from .write import PendingCheckpoint, file_entries, mark_latest, start, write

__all__ = [
    "KEEP", "LOCK_ENV", "LOCK_NAME", "STEP_RE", "TRUSTED_ENV", "PendingCheckpoint", "check_fits", "check_layout",
    "check_output_dir", "checkpoint_for", "exists", "file_entries", "find_resumable", "fitting_checkpoint", "holds_lock", "latest",
    "load_state", "lock_output_dir", "mark_latest", "model_shapes", "new_run_id", "preflight", "read_latest",
    "read_manifest", "read_portable", "read_rank_file", "recorded_run_id", "refuse_if_in_use", "resolve", "run_id_note", "save_state",
    "sha256_file", "start", "step_name", "unlock_output_dir", "verify", "write", "write_json", "open_own",
]
