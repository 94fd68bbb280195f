"""The LUMI guide's DeepSpeed script, on distkit: its argparse, its own loop, every engine.

The shape is the LUMI AI guide's ``ds_cifar.py`` (argparse with ``--local-rank`` and the
DeepSpeed flags, a CNN, ``model_engine.backward(loss)`` / ``model_engine.step()`` in its own
for-loop). The only changes: ``distkit.add_arguments`` where the guide calls
``deepspeed.add_config_arguments``, ``distkit.init`` + ``dk.setup`` where it calls
``deepspeed.init_distributed`` + ``deepspeed.initialize``, and ``dk.dataloader(train_loader)``
to shard the loader it already built. The data are scikit-learn's 8x8 digits as 1-channel
images (no download). It runs unchanged on every engine:

    torchrun --nproc_per_node 2 examples/lumi_deepspeed.py --deepspeed --deepspeed_config configs/ds_zero2.json
    deepspeed --num_gpus 2 examples/lumi_deepspeed.py --deepspeed --deepspeed_config configs/ds_zero2.json
    python examples/lumi_deepspeed.py --nprocs 2                                  # DDP
    mpirun -np 2 python examples/lumi_deepspeed.py ++use_horovod True             # Horovod
    python examples/lumi_deepspeed.py --nprocs 2 ++distributed '{"backend": "mpi"}'
    python examples/lumi_deepspeed.py --nprocs 2 ++torch_distributed "{'reduce_type': 'param', 'param_sync_step': 8}"

With ``configs/ds_zero2.json`` the optimizer (AdamW) and its warm-up schedule come from the
DeepSpeed config, as in the guide; on the other engines the script's own Adam is used.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distkit
from distkit.tasks.digits import datasets


class Net(nn.Module):
    """The guide's small CNN, sized for 8x8 one-channel images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))


def images() -> TensorDataset:
    train, _ = datasets()
    x, y = train.tensors
    return TensorDataset(x.view(-1, 1, 8, 8), y)


def main() -> None:
    parser = argparse.ArgumentParser(description="CIFAR-style CNN, the LUMI DeepSpeed example")
    parser.add_argument("--local-rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--epochs", type=int, default=2)
    parser = distkit.add_arguments(parser)  # the guide: parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    dk = distkit.init(args)  # the guide: deepspeed.init_distributed()
    net = Net()
    # The optimizer: the DeepSpeed config's block if it has one, else this factory.
    model_engine, optimizer = dk.setup(net, lambda params: torch.optim.Adam(params, lr=1e-3))
    train_loader = DataLoader(images(), batch_size=16, shuffle=True)
    train_loader = dk.dataloader(train_loader)  # this rank's shard of it, on dk.device
    criterion = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        train_loader.set_epoch(epoch)
        running_loss = 0.0
        for i, (inputs, labels) in enumerate(train_loader):
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            dk.backward(loss)  # the guide: model_engine.backward(loss)
            dk.step()          # the guide: model_engine.step()
            running_loss += loss.item()
            if i % 20 == 19:
                dk.print(f"[{epoch + 1}, {i + 1:3d}] loss: {running_loss / 20:.3f}")
                running_loss = 0.0
    dk.finish()
    summary = dk.summary()
    dk.print(f"finished on {summary['backend_impl']}: {summary['steps']} steps, ranks in sync: "
             f"{summary['ranks_in_sync']}, checksum {summary['param_checksum'][:12]}")


if __name__ == "__main__":
    main()
