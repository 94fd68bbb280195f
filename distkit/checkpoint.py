"""Atomic, resumable checkpoints (DESIGN.md section 6).

Layout under ``output_dir/checkpoints/``::

    step-0000040/rank-00000.pt ... rank-NNNNN.pt, manifest.json   (manifest written last)
    latest                                                         (text: "step-0000040")

Protocol (collective, every rank, :func:`write`): rank 0 makes a hidden temporary directory;
every rank writes its own file (``.part`` then rename); barrier; rank 0 writes the manifest,
renames the directory to its final name; barrier; then rank 0 replaces ``latest`` by rename
(:func:`mark_latest`). A kill at
any instant leaves ``latest`` pointing at the previous complete checkpoint. Each rank
saves its own state (in param mode ranks differ between syncs, and RNG states always do).
Assumes ``output_dir`` is on a filesystem every rank sees (one node, or a shared FS).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING, Any, Optional

import torch

from distkit import faults
from distkit.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from distkit.backends.base import Strategy

#: complete checkpoints kept; older ones are deleted after a new one is complete
KEEP = 3


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _agree_on_error(strategy: "Strategy", error: Optional[str]) -> None:
    """Collective: rank 0's error (or None) becomes every rank's, so all ranks raise together (no hang)."""
    error = strategy.broadcast_object(error, 0)
    if error:
        raise CheckpointError(error)


def write(strategy: "Strategy", final: str, state: dict[str, Any], model: Any = None, step: int = -1) -> str:
    """Collective: write this rank's ``state`` as the complete checkpoint directory ``final``, atomically.

    Every rank writes its own file into a hidden temporary sibling (``.part`` then rename); after a
    barrier rank 0 writes the manifest and moves the directory into place. An existing ``final`` is
    moved aside first and deleted only after the new one is in place, so a kill at any instant leaves
    a complete checkpoint under ``final`` or its predecessor intact. Engines with their own format
    (DeepSpeed) write it through ``strategy.save_engine_files`` into the same directory, covered by
    the same manifest. An unwritable location raises :class:`CheckpointError` on every rank before
    anything is written.
    """
    final = os.path.abspath(final)
    parent, name = os.path.split(final)
    tmp = os.path.join(parent, f".{name}.tmp")
    error = None
    if strategy.is_main:
        try:
            os.makedirs(parent, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = (f"cannot write checkpoint '{final}': {e.strerror or e}: choose a writable directory "
                     "(the previous checkpoint is intact)")
    _agree_on_error(strategy, error)
    strategy.save_engine_files(tmp, model)
    path = os.path.join(tmp, _rank_file(strategy.rank))
    torch.save(state, path + ".part")
    os.replace(path + ".part", path)
    faults.maybe_fire(strategy.rank, step, "checkpoint")
    strategy.barrier()  # every rank's file is complete
    if strategy.is_main:
        files = {os.path.relpath(os.path.join(d, f), tmp): os.path.getsize(os.path.join(d, f))
                 for d, _, names in os.walk(tmp) for f in names}
        manifest = {"step": step, "world_size": strategy.world_size, "files": dict(sorted(files.items()))}
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f)
        old = os.path.join(parent, f".{name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    strategy.barrier()
    return final


def mark_latest(root: str, name: str) -> None:
    """Point ``root/latest`` at checkpoint ``name`` (by rename: atomic) and keep the newest :data:`KEEP`.
    Not collective: rank 0 calls it after :func:`write` returned."""
    with open(os.path.join(root, "latest.tmp"), "w") as f:
        f.write(name)
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    _prune(root)


def step_name(step: int) -> str:
    return f"step-{step:07d}"


def _prune(root: str) -> None:
    done = sorted(d for d in os.listdir(root) if d.startswith("step-"))
    for old in done[:-KEEP]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def latest(root: str) -> Optional[str]:
    """The directory ``latest`` points to, or None when there is no complete checkpoint."""
    pointer = os.path.join(root, "latest")
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        path = os.path.join(root, f.read().strip())
    return path if os.path.isfile(os.path.join(path, "manifest.json")) else None


def load(path: str, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's state from a complete checkpoint directory (not collective)."""
    manifest_path = os.path.join(path, "manifest.json")
    if not os.path.isfile(manifest_path):
        raise ConfigError(f"'{path}' is not a complete distkit checkpoint (no manifest.json): pick another or use resume='auto'")
    with open(manifest_path) as f:
        manifest = json.load(f)
    if manifest["world_size"] != world_size:
        raise ConfigError(f"checkpoint '{path}' was written by {manifest['world_size']} ranks, this run has "
                          f"{world_size}: resume with the same number of ranks")
    return torch.load(os.path.join(path, _rank_file(rank)), map_location="cpu", weights_only=False)  # type: ignore[no-any-return]
