"""``distkit convert SRC DST``: a checkpoint's portable part between its sharded and a single-file form.

* ``distkit convert CKPT state.pt``: the whole training state of checkpoint CKPT (any engine, any
  number of ranks) in one ``torch.save`` file: ``model/<name>`` and ``optim/<parameter>/<key>``
  tensors and the ``meta`` dict (optimizer groups, progress, scheduler state and the run's other
  entries), the form ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` writes.
* ``distkit convert state.pt DIR``: such a file back into a complete, verified checkpoint directory
  (portable part, manifest with sha256), which ``++resume DIR`` continues on any engine, number of
  ranks and mode, like the checkpoint it came from.

Neither direction needs a process group or the model's code. Every file is written atomically; an
existing DST is refused (nothing is overwritten).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any

import torch

from distkit import checkpoint, portable
from distkit.errors import CheckpointError, ConfigError
from distkit.commands.export import loadable, located


class _OneProcess:
    """The object collectives of a single process: what :func:`portable.save` needs to run alone."""

    rank, world_size = 0, 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj


def to_file(path: str, out: str) -> str:
    """Write the portable state of checkpoint ``path`` to the single file ``out``; returns the checkpoint."""
    ckpt = located(path, "converting")
    problem = checkpoint.verify(ckpt, under=portable.DIR)
    if problem:
        raise ConfigError(f"checkpoint '{ckpt}' is damaged: {problem}")
    loadable(ckpt)
    entries = portable.read(ckpt)
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    torch.save(entries, out + ".part")
    os.replace(out + ".part", out)
    return ckpt


def to_checkpoint(path: str, out: str) -> dict[str, Any]:
    """Write the single file ``path`` (from :func:`to_file`) as checkpoint directory ``out``; returns
    its manifest. The manifest names no engine ("portable"), so every resume goes through the portable
    part; RNG states are not in the file, so a resume keeps the seeds it starts with."""
    try:
        entries = portable.load_file(path)
        meta = entries[portable.META]
        progress = meta["progress"]
    except CheckpointError:  # a file that would run code: its own line
        raise
    except Exception as e:  # not a file `distkit convert CKPT FILE` wrote
        raise ConfigError(f"'{path}' is not a single-file distkit checkpoint ({type(e).__name__}: {e}): write one with "
                          "`distkit convert CKPT state.pt`") from None
    final = os.path.abspath(out)
    tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tensors = {k: v for k, v in entries.items() if k != portable.META}
        portable.save(_OneProcess(), os.path.join(tmp, portable.DIR), tensors, meta)  # type: ignore[arg-type]
        model = portable.model_state(entries)
        manifest = {"format": 3, "step": progress["step"], "samples": progress["samples"],
                    "global_batch": progress.get("global_batch"), "portable": True,
                    "world_size": meta.get("world_size", 1), "engine": "portable", "reduce_type": meta.get("reduce_type"),
                    "zero_stage": None, "files": checkpoint.file_entries(tmp),
                    "shapes": {k: list(v.shape) for k, v in model.items()}}
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def add_parser(sub: "argparse._SubParsersAction[Any]") -> argparse.ArgumentParser:
    """Register ``convert`` on the CLI's subcommand parser."""
    c = sub.add_parser("convert", help="a checkpoint's portable state to one file, or such a file back to a checkpoint",
                       description=(__doc__ or "").splitlines()[0], allow_abbrev=False)
    c.add_argument("source", metavar="SRC", help="checkpoint directory (or output_dir), or a file `convert` wrote")
    c.add_argument("dest", metavar="DST", help="file to write (from a checkpoint), or checkpoint directory (from a file)")
    return c


def run(args: argparse.Namespace) -> int:
    if os.path.exists(args.dest):
        raise ConfigError(f"'{args.dest}' exists: choose a new name (convert overwrites nothing)")
    if os.path.isfile(args.source):
        manifest = to_checkpoint(args.source, args.dest)
        print(f"distkit: wrote checkpoint {args.dest} (step {manifest['step']}, {len(manifest['shapes'])} model tensors); "
              f"continue it with ++resume {args.dest}", flush=True)
    else:
        ckpt = to_file(args.source, args.dest)
        print(f"distkit: wrote the portable state of {ckpt} to {args.dest}", flush=True)
    return 0
