#!/bin/bash
# usage: scripts/param_checksums.sh REPO OUTFILE: the param_checksum (and ranks_in_sync) of 12 short runs of REPO
# (ddp, mpi, horovod, fsdp, DeepSpeed ZeRO 1-3, grad and param mode, and a resumed run), one line each. Run it on a
# clone before and after a change that must not change any number, then diff the two files (issue 24).
PY="${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}"
OUTFILE="$(realpath -m "$2")"
cd "$1" || exit 1
T=$(mktemp -d)
run() { name=$1; shift; $PY -m distkit train configs/returnn_ddp.py ++max_steps 12 ++checkpoint_every 6 ++log_every 6 ++progress_bar False --nprocs 2 ++output_dir $T/$name "$@" >/dev/null 2>$T/$name.err; echo "$name $($PY -c "import json,sys; s=json.load(open('$T/$name/summary.json')); print(s['param_checksum'], s['ranks_in_sync'])" 2>/dev/null || echo FAILED)"; }
{
run ddp_grad
run ddp_param ++distributed "{'reduce_type': 'param', 'param_sync_step': 4}"
run mpi_grad ++torch_distributed None ++distributed.backend mpi
run mpi_param ++torch_distributed None ++distributed "{'backend': 'mpi', 'reduce_type': 'param', 'param_sync_step': 4}"
run hvd_grad ++torch_distributed None ++use_horovod 1
run ds_z1 ++distributed '{"backend": "deepspeed", "deepspeed_config": {"zero_optimization": {"stage": 1}}}'
run ds_z2 ++distributed '{"backend": "deepspeed", "deepspeed_config": {"zero_optimization": {"stage": 2}}}'
run ds_z3 ++distributed '{"backend": "deepspeed", "deepspeed_config": {"zero_optimization": {"stage": 3}}}'
run fsdp_grad ++torch_distributed None ++distributed.backend fsdp
run fsdp_param ++torch_distributed None ++distributed "{'backend': 'fsdp', 'reduce_type': 'param', 'param_sync_step': 4}"
run ds_param ++distributed '{"backend": "deepspeed", "reduce_type": "param", "param_sync_step": 4, "deepspeed_config": {"zero_optimization": {"stage": 2}}}'
$PY -m distkit train configs/returnn_ddp.py ++max_steps 18 ++checkpoint_every 6 ++log_every 6 ++progress_bar False --nprocs 2 ++output_dir $T/ddp_grad ++resume auto >/dev/null 2>&1; echo "ddp_resumed $($PY -c "import json; print(json.load(open('$T/ddp_grad/summary.json'))['param_checksum'])")"
} > "$OUTFILE"
rm -rf $T
