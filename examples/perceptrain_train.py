# perceptrain's documented distributed-training example `train.py` (docs/tutorials/distributed/
# multi_gpu.md in pasqal-io/perceptrain), unchanged except for its two perceptrain import lines,
# which now import distkit.compat.perceptrain. Run it as:
#
#   python examples/perceptrain_train.py --nprocs 2 --backend gloo --compute_setup cpu
#   torchrun --nproc_per_node 2 examples/perceptrain_train.py --backend gloo --compute_setup cpu
#   python examples/perceptrain_train.py --nprocs 2 --backend mpi --compute_setup cpu     # distkit's mpi engine
#
# Logs, metrics.jsonl, summary.json and checkpoints go to ./qml_logs (TrainConfig.root_folder).
import torch
import argparse
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset
from distkit.compat.perceptrain import TrainConfig, Trainer
from distkit.compat.perceptrain.optimize_step import optimize_step
Trainer.set_use_grad(True)

# __main__ is recommended.
if __name__ == "__main__":
    # simple dataset for y = 2πx
    x = torch.linspace(0, 1, 100).reshape(-1, 1)
    y = torch.sin(2 * torch.pi * x)
    dataloader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    # Simple model with no hidden layer and ReLU activation to fit the data for y = 2πx
    model = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 1))
    # SGD optimizer with 0.01 learning rate
    optimizer = optim.SGD(model.parameters(), lr=0.01)

    # TrainConfig
    parser = argparse.ArgumentParser()
    parser.add_argument("--nprocs", type=int,
                        default=1, help="Number of processes (GPUs) to use.")
    parser.add_argument("--compute_setup", type=str,
                        default="auto", choices=["cpu", "gpu", "auto"], help="Computational Setup.")
    parser.add_argument("--backend", type=str,
                        default="nccl", choices=["nccl", "gloo", "mpi"], help="Distributed backend.")
    args = parser.parse_args()
    train_config = TrainConfig(
                                backend=args.backend,
                                nprocs=args.nprocs,
                                compute_setup=args.compute_setup,
                                print_every=5,
                                max_iter=50
                            )

    trainer = Trainer(model, optimizer, train_config, loss_fn="mse", optimize_step=optimize_step)
    trainer.fit(dataloader)
