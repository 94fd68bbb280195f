"""``distkit export CKPT OUT``: the trained model as one plain ``state_dict`` file, a safetensors file or
a Hugging Face model directory, from any engine's checkpoint.

CKPT is a checkpoint directory (``.../checkpoints/step-0000040``), a ``checkpoints/`` root or
an ``output_dir`` (both: the checkpoint ``latest`` points to). The model comes from the
checkpoint's engine-neutral portable part (any engine, world size or ZeRO stage; no process
group, no model code); checkpoints written before it existed are read the old way (DeepSpeed's
files through ``deepspeed.utils.zero_to_fp32``, else rank 0's file). OUT decides the format:

* ``model.pt`` (or any other name): ``torch.save`` of the ``state_dict``;
  ``model.load_state_dict(torch.load("model.pt"))``;
* ``model.safetensors``: the same tensors in safetensors (``safetensors.torch.load_file``);
* a directory (an existing one, or a name ending in ``/``): ``model.safetensors`` plus, for a
  Hugging Face model, its ``config.json``, so ``AutoModel*.from_pretrained(OUT)`` loads it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

import torch

from distkit import checkpoint, portable
from distkit.errors import CheckpointError, ConfigError, DistkitError


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


def locate(path: str, doing: str = "inspecting") -> tuple[str, list[str]]:
    """Like :func:`find_checkpoint`, but when ``latest`` is missing or damaged (or names no complete
    checkpoint) the newest complete checkpoint, as ``++resume auto`` finds it, with a note saying why
    (worded with ``doing``): what a resume would use is still there to inspect."""
    try:
        return find_checkpoint(path), []
    except ConfigError:
        for root in (path, os.path.join(path, "checkpoints")):
            found, notes = checkpoint.find_resumable(root, doing)
            if found:
                return found, notes
        raise


def located(path: str, doing: str) -> str:
    """:func:`locate`, printing its notes (why not ``latest``) on stderr, one line each."""
    ckpt, notes = locate(path, doing)
    for note in notes:
        print(f"distkit: {note}", file=sys.stderr, flush=True)
    return ckpt


def loadable(ckpt: str) -> None:
    """Raise :class:`~distkit.errors.CheckpointError` naming the first file of ``ckpt`` whose loading would run code
    (a rank file, DeepSpeed's, the portable part's metadata): the pickles are read, never run."""
    files = sorted(os.path.join(dirpath, f) for dirpath, _, names in os.walk(ckpt) for f in names if f.endswith(".pt"))
    portable.check_files(files, portable.DEEPSPEED_GLOBALS)
    if portable.exists(ckpt):
        portable.read_meta(ckpt)


def consolidated_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the model's ``state_dict``, whole and fp32 (integer buffers keep their dtype)."""
    ckpt = find_checkpoint(path)
    if portable.exists(ckpt):
        return {k: (v.float() if v.is_floating_point() else v) for k, v in portable.model_state(portable.read(ckpt)).items()}
    if os.path.isdir(os.path.join(ckpt, "deepspeed")):
        from distkit.backends.deepspeed import consolidated_state_dict as from_deepspeed

        return from_deepspeed(ckpt)
    state = portable.load_file(os.path.join(ckpt, "rank-00000.pt"))
    return {k: (v.float() if v.is_floating_point() else v).clone() for k, v in state["model"].items()}


def _hf_config(ckpt: str) -> Optional[dict[str, Any]]:
    """The Hugging Face ``config.json`` content saved with the checkpoint (None: not an HF model)."""
    if not portable.exists(ckpt):
        return None
    meta = portable.read_meta(ckpt)
    return meta.get("hf_config")  # type: ignore[no-any-return]


def _atomic(out: str, write: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    write(out + ".part")
    os.replace(out + ".part", out)


def _save_safetensors(sd: dict[str, torch.Tensor], path: str) -> None:
    """``sd`` as one safetensors file, each tensor separate (tied weights were written once each);
    ``"format": "pt"`` is what ``from_pretrained`` expects."""
    from safetensors.torch import save_file  # imported when used: only this format needs it

    save_file({k: v.contiguous() for k, v in sd.items()}, path, metadata={"format": "pt"})


def export(path: str, out: str) -> tuple[str, list[str]]:
    """Write the model of checkpoint ``path`` to ``out`` (format by name, see the module docstring;
    each file atomically). Returns the checkpoint used and the files written. Where ``latest`` is missing
    or damaged, the newest complete checkpoint is used, as ``++resume auto`` would, with a line on stderr."""
    ckpt = located(path, "exporting")
    problem = checkpoint.verify(ckpt)  # as a resume does: a damaged checkpoint exported a model 0.03 off, exit 0
    if problem:
        raise CheckpointError(f"checkpoint '{ckpt}' is damaged: {problem}; export another checkpoint (distkit "
                              "inspect lists them)")
    loadable(ckpt)  # (a hostile file it would not read is still refused: the checkpoint is not to be trusted)
    sd = consolidated_state_dict(ckpt)
    if out.endswith(os.sep) or os.path.isdir(out):
        os.makedirs(out, exist_ok=True)
        _atomic(os.path.join(out, "model.safetensors"), lambda p: _save_safetensors(sd, p))
        written = [os.path.join(out, "model.safetensors")]
        config = _hf_config(ckpt)
        if config is not None:
            def dump(p: str) -> None:
                with open(p, "w") as f:
                    json.dump(config, f, indent=2)
            _atomic(os.path.join(out, "config.json"), dump)
            written.append(os.path.join(out, "config.json"))
        return ckpt, written
    if out.endswith(".safetensors"):
        _atomic(out, lambda p: _save_safetensors(sd, p))
    else:
        _atomic(out, lambda p: torch.save(sd, p))
    return ckpt, [out]


def add_parser(sub: "argparse._SubParsersAction[Any]") -> argparse.ArgumentParser:
    """Register ``export`` on the CLI's subcommand parser."""
    e = sub.add_parser("export", help="write a plain consolidated state_dict from a checkpoint",
                       description=__doc__.splitlines()[0])
    e.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory, checkpoints/ root or output_dir")
    e.add_argument("output", metavar="OUT", help="model.pt (torch.save), model.safetensors, or a directory (model.safetensors "
                   "+ config.json of a Hugging Face model, for from_pretrained)")
    return e


def run(args: argparse.Namespace) -> int:
    ckpt, written = export(args.checkpoint, args.output)
    print(f"distkit: exported the model of {ckpt} to {', '.join(written)}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m distkit.commands.export CKPT OUT`` (the same as ``distkit export``)."""
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
