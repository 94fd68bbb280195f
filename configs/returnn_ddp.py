# RETURNN-style config: DDP in gradient mode, exactly as in RETURNN (`torch_distributed = {}`).
#   distkit train configs/returnn_ddp.py --nprocs 2
#   torchrun --nproc_per_node 2 -m distkit train configs/returnn_ddp.py
task = "digits"
torch_distributed = {}
optimizer = {"class": "sgd"}
learning_rate = 0.1
batch_size = 16          # per rank
num_epochs = 5
log_every = 10
output_dir = "runs/returnn_ddp"
