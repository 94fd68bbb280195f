"""``distkit export CKPT model.pt``: a plain, consolidated fp32 ``state_dict`` from a checkpoint.

CKPT is a checkpoint directory (``.../checkpoints/step-0000040``), a ``checkpoints/`` root or
an ``output_dir`` (both: the checkpoint ``latest`` points to). DeepSpeed checkpoints of any
ZeRO stage are consolidated with ``deepspeed.utils.zero_to_fp32`` (no process group, no
model code needed); checkpoints of the other backends hold the whole model in rank 0's file.
The result loads into the bare model::

    model.load_state_dict(torch.load("model.pt"))
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from distkit import checkpoint
from distkit.errors import ConfigError, DistkitError


def find_checkpoint(path: str) -> str:
    """The complete checkpoint directory ``path`` names (directly, or through ``latest``)."""
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    for root in (path, os.path.join(path, "checkpoints")):
        found = checkpoint.latest(root)
        if found:
            return found
    raise ConfigError(f"'{path}' is neither a complete distkit checkpoint nor a directory with checkpoints/latest: "
                      "pass a checkpoints/step-NNNNNNN directory or the run's output_dir")


def consolidated_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the model's ``state_dict``, whole and fp32 (integer buffers keep their dtype)."""
    ckpt = find_checkpoint(path)
    if os.path.isdir(os.path.join(ckpt, "deepspeed")):
        from distkit.backends.deepspeed import consolidated_state_dict as from_deepspeed

        return from_deepspeed(ckpt)
    state = torch.load(os.path.join(ckpt, "rank-00000.pt"), map_location="cpu", weights_only=False)
    return {k: (v.float() if v.is_floating_point() else v).clone() for k, v in state["model"].items()}


def export(path: str, out: str) -> str:
    """Write the consolidated state_dict of checkpoint ``path`` to ``out`` (atomically); returns the checkpoint used."""
    ckpt = find_checkpoint(path)
    sd = consolidated_state_dict(ckpt)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    torch.save(sd, out + ".part")
    os.replace(out + ".part", out)
    return ckpt


def add_parser(sub: "argparse._SubParsersAction[Any]") -> argparse.ArgumentParser:
    """Register ``export`` on the CLI's subcommand parser."""
    e = sub.add_parser("export", help="write a plain consolidated state_dict from a checkpoint",
                       description=__doc__.splitlines()[0])
    e.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory, checkpoints/ root or output_dir")
    e.add_argument("output", metavar="OUT", help="file to write, e.g. model.pt")
    return e


def run(args: argparse.Namespace) -> int:
    ckpt = export(args.checkpoint, args.output)
    n = len(torch.load(args.output, weights_only=True))
    print(f"distkit: exported {n} tensors from {ckpt} to {args.output}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m distkit.export CKPT OUT`` (the same as ``distkit export``)."""
    parser = argparse.ArgumentParser(prog="distkit export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", metavar="CKPT")
    parser.add_argument("output", metavar="OUT")
    try:
        return run(parser.parse_args(argv))
    except DistkitError as e:
        print(f"distkit: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
