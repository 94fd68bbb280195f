# The demo run (`make demo`): the built-in digits task on 2 DDP ranks (RETURNN style).
task = "digits"
torch_distributed = {}
optimizer = {"class": "sgd", "momentum": 0.9}
learning_rate = 0.05
batch_size = 16
num_epochs = 10
log_every = 10
output_dir = "runs/demo"
resume = "none"          # `make demo` trains from scratch every time (replacing runs/demo's checkpoints)
