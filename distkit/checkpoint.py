"""Atomic, resumable checkpoints (DESIGN.md section 6).

Layout under ``output_dir/checkpoints/``::

    step-0000040/rank-00000.pt ... rank-NNNNN.pt, manifest.json   (manifest written last)
    latest                                                         (text: "step-0000040")

Protocol (collective, every rank): rank 0 makes a hidden temporary directory; every rank
writes its own file (``.part`` then rename); barrier; rank 0 writes the manifest, renames
the directory to its final name, then replaces ``latest`` by rename; barrier. A kill at
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
from distkit.errors import ConfigError

if TYPE_CHECKING:
    from distkit.backends.base import Strategy

#: complete checkpoints kept; older ones are deleted after a new one is complete
KEEP = 3


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def save(strategy: "Strategy", root: str, step: int, state: dict[str, Any], model: Any = None) -> str:
    """Collective: write this rank's ``state`` into checkpoint ``step``; returns its directory.

    Engines with their own format (DeepSpeed) write it into the same temporary directory
    through ``strategy.save_engine_files`` first, so it is covered by the same manifest.
    """
    name = f"step-{step:07d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".{name}.tmp")
    if strategy.is_main:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    strategy.barrier()
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
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(name)
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        _prune(root)
    strategy.barrier()
    return final


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
