"""``distkit inspect CKPT``: what a checkpoint holds and whether it is intact, without loading a model.

CKPT is a checkpoint directory, a ``checkpoints/`` root or an ``output_dir`` (as for ``distkit export``).
Reported: step, samples (global), global batch, engine, reduce_type, ZeRO stage, world size, whether it
has the engine-neutral portable part (then it resumes anywhere), the model's tensors
(count, elements, fp32 bytes, from the manifest's shapes), every file with its size, and integrity:
each file's size and sha256 against the manifest. Exit status 0 when intact, 1 when damaged, 2 for
a path that is not a checkpoint or an intact one whose loading would run code (every file's pickle is read, never
run: docs/security.md). When the run's ``latest`` is missing or damaged, the newest complete
checkpoint is inspected and one line on stderr says so (as ``++resume auto`` does).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from distkit import checkpoint, portable
from distkit.commands.export import loadable, locate


def describe(path: str) -> dict[str, Any]:
    """The report for checkpoint ``path`` (see the module docstring) as a dict; ``notes``: why it is not the
    checkpoint ``latest`` names (missing or damaged), as ``++resume auto`` says it."""
    ckpt, notes = locate(path)
    manifest = checkpoint.read_manifest(ckpt)
    info: dict[str, Any] = {"checkpoint": ckpt, "step": manifest.get("step"), "samples": manifest.get("samples"),
                            "engine": manifest.get("engine"), "reduce_type": manifest.get("reduce_type"),
                            "zero_stage": manifest.get("zero_stage"), "world_size": manifest["world_size"],
                            "global_batch": manifest.get("global_batch"), "portable": bool(manifest.get("portable"))}
    if info["engine"] is None:  # written before the manifest named them: the run's resolved config says
        resolved = os.path.join(os.path.dirname(os.path.dirname(ckpt)), "config.resolved.json")
        if os.path.isfile(resolved):
            with open(resolved) as f:
                dist = json.load(f).get("distributed", {})
            info["engine"], info["reduce_type"] = dist.get("backend"), dist.get("reduce_type")
    problem = checkpoint.verify(ckpt)
    if problem is None:
        loadable(ckpt)
    if info["samples"] is None and problem is None:
        rank0 = os.path.join(ckpt, "rank-00000.pt")
        if os.path.isfile(rank0):
            saved = portable.load_file(rank0)
            info["samples"] = saved.get("distkit", {}).get("progress", {}).get("samples")
    shapes = manifest.get("shapes") or {}
    elements = sum(math.prod(s) for s in shapes.values())
    info["tensors"] = len(shapes) or None
    info["elements"] = elements if shapes else None
    info["fp32_bytes"] = elements * 4 if shapes else None
    info["files"] = {rel: meta["size"] if isinstance(meta, dict) else meta for rel, meta in manifest["files"].items()}
    info["bytes_on_disk"] = sum(info["files"].values())
    info["intact"] = problem is None
    info["problem"] = problem
    info["notes"] = notes
    return info


def add_parser(sub: "argparse._SubParsersAction[Any]") -> argparse.ArgumentParser:
    """Register ``inspect`` on the CLI's subcommand parser."""
    p = sub.add_parser("inspect", help="what a checkpoint holds and whether it is intact",
                       description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory, checkpoints/ root or output_dir")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    info = describe(args.checkpoint)
    for note in info["notes"]:  # on stderr: --json's stdout stays one JSON object
        print(f"distkit: {note}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(info, indent=2), flush=True)
        return 0 if info["intact"] else 1
    stage = f", ZeRO-{info['zero_stage']}" if info["zero_stage"] is not None else ""
    print(f"checkpoint   {info['checkpoint']}")
    print(f"progress     step {info['step']}, {info['samples']} samples")
    print(f"written by   {info['engine']}/{info['reduce_type']}{stage} on {info['world_size']} rank(s)")
    print("portable     " + ("yes: resumes on any engine, number of ranks and mode" if info["portable"] else
                             "no (an earlier distkit wrote it): resumes only with the engine, ranks and mode above"))
    if info["tensors"] is not None:
        print(f"model        {info['tensors']} tensors, {info['elements']:,} elements "
              f"({info['fp32_bytes'] / 2 ** 20:.2f} MiB as fp32)")
    print(f"files        {len(info['files'])}, {info['bytes_on_disk'] / 2 ** 20:.2f} MiB")
    for rel, size in info["files"].items():
        print(f"  {rel:<40} {size:>12,} bytes")
    print(f"integrity    {'intact (every file matches the manifest)' if info['intact'] else 'DAMAGED: ' + str(info['problem'])}",
          flush=True)
    return 0 if info["intact"] else 1
