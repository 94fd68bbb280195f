# RETURNN-style Horovod config: local steps + parameter averaging every 100 steps, as RETURNN
# recommends for Horovod ("param" reduce type with random_seed_offset data distribution).
#   mpirun -np 2 .venv/bin/python -m distkit train configs/returnn_horovod.py
#   horovodrun -np 2 --gloo .venv/bin/python -m distkit train configs/returnn_horovod.py
# Without Horovod installed this runs on distkit's mpi engine (one line says so); set
# horovod_require = True to make that an error instead. Install Horovod: make horovod.
task = "digits"
use_horovod = True
horovod_reduce_type = "param"                       # "grad": all-reduce gradients every step
horovod_param_sync_step = 100                       # average parameters every 100 optimizer steps
horovod_dataset_distribution = "random_seed_offset"  # each rank its own shuffle ("shard": disjoint slices)
horovod_scale_lr = False                            # True: learning_rate * world size
optimizer = {"class": "adam"}
learning_rate = 0.001
batch_size = 16          # per rank
num_epochs = 5
log_every = 10
output_dir = "runs/returnn_horovod"
