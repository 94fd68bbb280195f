"""Run a SpeechBrain recipe as ``python train.py hparams.yaml ARGS`` would, then write what distkit's tests compare:
every rank's final model state (whole tensors) to ``OUTPUT_FOLDER/final-<rank>.pt`` and, under distkit, the Session's
``ranks_in_sync`` to ``OUTPUT_FOLDER/summary-<rank>.json``.

    python tests/sb_recipes/run.py [--no-syncbn] RECIPE.py HPARAMS.yaml ARGS...

``--no-syncbn``: SpeechBrain's own DDP without its SyncBatchNorm conversion, which torch allows on CUDA only: the
CPU reference the tests compare distkit with (BatchNorm statistics as plain DDP keeps them).
"""
import json
import os
import runpy
import sys

import torch

argv = sys.argv[1:]
if argv and argv[0] == "--no-syncbn":
    torch.nn.SyncBatchNorm.convert_sync_batchnorm = staticmethod(lambda module, *a, **k: module)
    argv = argv[1:]
sys.argv = argv
names = runpy.run_path(argv[0], run_name="__main__")

import speechbrain  # noqa: E402 (after the recipe: its own import comes first, as in a plain run)

brain = next(v for v in names.values() if isinstance(v, speechbrain.Brain))
out = names["hparams"]["output_folder"]
dk = getattr(brain, "dk", None)
if dk is not None:  # distkit: the engine's whole state (collective), and whether the ranks hold the same
    state, rank = dk.state_dict(), dk.rank
    with open(os.path.join(out, f"summary-{rank}.json"), "w") as f:
        d = dk.cfg.distributed
        json.dump({"ranks_in_sync": dk.summary()["ranks_in_sync"], "backend": dk.backend,
                   "reduce_type": d.reduce_type, "param_sync_step": d.param_sync_step,
                   "outer_optimizer": d.outer_optimizer}, f)
else:  # SpeechBrain's DDP: the modules it wrapped, under distkit's names for them
    rank = int(os.environ.get("RANK", "0"))
    state = {f"brain_modules.{name}.{k}": v.detach().clone()
             for name, m in brain.modules.items() if any(p.requires_grad for p in m.parameters())
             for k, v in getattr(m, "module", m).state_dict().items()}
torch.save(state, os.path.join(out, f"final-{rank}.pt"))
