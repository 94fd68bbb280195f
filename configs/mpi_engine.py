# distkit's own MPI engine (mpi4py, no torch.distributed): bucketed, overlapped gradient all-reduce.
#   mpirun -np 2 .venv/bin/python -m distkit train configs/mpi_engine.py
task = "digits"
distributed = {"backend": "mpi", "reduce_type": "grad", "bucket_cap_mb": 25}
optimizer = {"class": "sgd", "momentum": 0.9}
learning_rate = 0.05
batch_size = 16
num_epochs = 5
output_dir = "runs/mpi_engine"
