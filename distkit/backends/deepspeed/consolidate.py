"""A plain fp32 ``state_dict`` from a DeepSpeed engine checkpoint (``distkit export``)."""
from __future__ import annotations

import os

import torch

from distkit import portable
from distkit.errors import ConfigError

from .config import ENGINE_DIR, TAG


def consolidated_state_dict(checkpoint_dir: str, group: int = 0) -> dict[str, torch.Tensor]:
    """A plain fp32 ``state_dict`` of the whole model from a distkit checkpoint written by this backend,
    any ZeRO stage (not collective; no process group needed). Used by ``distkit export``. Built from the
    optimizer's fp32 master weights where there are any. ``group``: which replica group (param mode)."""
    root = os.path.join(checkpoint_dir, ENGINE_DIR)
    if not os.path.isdir(root):
        raise ConfigError(f"'{checkpoint_dir}' holds no DeepSpeed engine state: export needs a checkpoint of the "
                          "deepspeed backend")
    sub = "all" if os.path.isdir(os.path.join(root, "all")) else f"group-{group}"  # param mode: groups agree after the final sync
    path = os.path.join(root, sub)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    tag_dir = os.path.join(path, TAG)
    # zero_to_fp32 and the line below read with torch.load(weights_only=False): checked first
    portable.check_files([os.path.join(tag_dir, f) for f in sorted(os.listdir(tag_dir)) if f.endswith(".pt")],
                         portable.DEEPSPEED_GLOBALS)
    if any("zero_pp_rank" in f for f in os.listdir(tag_dir)):
        from deepspeed.utils import zero_to_fp32  # type: ignore[import-untyped]

        sd = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(path, tag=TAG)
    else:  # stage 0 fp32: the model states file holds the whole module
        files = sorted(f for f in os.listdir(tag_dir) if f.endswith("model_states.pt"))
        sd = torch.load(os.path.join(tag_dir, files[0]), map_location="cpu", weights_only=False)["module"]  # (checked)
    return {k: (v.float() if v.is_floating_point() else v).clone() for k, v in sd.items()}
