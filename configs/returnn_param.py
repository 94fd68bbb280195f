# RETURNN-style config: local steps + parameter averaging every 100 steps (reduce_type "param").
#   distkit train configs/returnn_param.py --nprocs 2
task = "digits"
torch_distributed = {"reduce_type": "param", "param_sync_step": 100}
data_distribution = "random_seed_offset"   # RETURNN's recommendation for param mode
optimizer = {"class": "adam"}
learning_rate = 0.001
batch_size = 16
num_epochs = 5
output_dir = "runs/returnn_param"
