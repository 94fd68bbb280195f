#!/bin/bash
# The GPU checks of issue 38 in one run (< 10 minutes on one GPU, no network): DDP grad and param on CUDA/NCCL,
# bf16/fp16 through a checkpoint, ZeRO-1/2/3 one run each, param mode's overlapped int8 exchange, the fsdp engine;
# one table at the end. `scripts/gpu_check.sh --device cpu` runs the same checks on the CPU. See scripts/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
export DS_BUILD_OPS=0  # DeepSpeed's ops JIT-build when first used; each check's own time limit bounds that
exec timeout 570 "$PY" scripts/gpu_check.py "$@"
