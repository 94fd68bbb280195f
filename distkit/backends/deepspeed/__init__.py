"""DeepSpeed (ZeRO stages 0-3) as a distkit backend.

grad mode: the DeepSpeed engine does everything it normally does: ``engine.backward``,
``engine.step``, engine-managed gradient accumulation, ZeRO partitioning, clipping,
bf16/fp16, its optimizer/scheduler blocks. distkit only drives the loop.

param mode (DeepSpeed has none): replica groups of ``distributed.param_sync_group_size``
consecutive ranks, each one DeepSpeed data-parallel world, averaged across groups every
``param_sync_step`` steps (:mod:`.groups`).

Config: the DeepSpeed JSON (``cfg.distributed.deepspeed_config``) is honoured; overlapping
DeepSpeed and distkit keys must agree (:mod:`.config`).

Modules: :mod:`.config` (config resolution and checks, constants), :mod:`.groups` (param mode:
replica groups, master averager), :mod:`.state` (model/optimizer state, engine checkpoints),
:mod:`.engine` (:class:`DeepSpeedStrategy`), :mod:`.consolidate` (:func:`consolidated_state_dict`
for ``distkit export``). Importing this package does not import DeepSpeed.
"""
from __future__ import annotations

from .config import ENGINE_DIR, RESOLVED_NAME, TAG, zero_section
from .consolidate import consolidated_state_dict
from .engine import DeepSpeedStrategy
from .engine import _CollectiveForward  # noqa: F401  # its old path: a pickled ZeRO-3 module refers to it there

__all__ = ["DeepSpeedStrategy", "consolidated_state_dict", "RESOLVED_NAME", "ENGINE_DIR", "TAG", "zero_section"]
