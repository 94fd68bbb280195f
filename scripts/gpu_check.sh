#!/bin/bash
# The GPU checks of issue 38 in one run (< 10 minutes on one GPU, no network): DDP grad and param on CUDA/NCCL,
# bf16/fp16 through a checkpoint, ZeRO-1/2/3 one run each, param mode's overlapped int8 exchange, the fsdp engine;
# one table at the end. `scripts/gpu_check.sh --device cpu` runs the same checks on the CPU. See scripts/gpu_check.py.
# Then the RETURNN case (docs/returnn.md; about 1 minute, at most 150 s more): RETURNN's own engine (`python -m
# returnn`) on CUDA, one rank per GPU, its DDP and its param mode against distkit's ddp, mpi and horovod engines
# through distkit.integrations.returnn, parameters and Adam's state after each of 2 epochs within 1e-6 (tests/test_returnn.py's
# parity cases with DISTKIT_RETURNN_DEVICE=cuda). `scripts/gpu_check.sh --returnn [--device cpu]` runs only that case.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
export DS_BUILD_OPS=0  # DeepSpeed's ops JIT-build when first used; each check's own time limit bounds that
rc=0
if [ "${1:-}" = "--returnn" ]; then shift; else timeout 570 "$PY" scripts/gpu_check.py "$@" || rc=$?; fi
device=cuda
[[ " $* " == *" --device cpu "* ]] && device=cpu
DISTKIT_RETURNN_DEVICE=$device timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_returnn.py -k trains \
    || rc=1
exit $rc
