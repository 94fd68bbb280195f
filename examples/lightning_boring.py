"""Lightning's bug-report template (examples/pytorch/bug_report/bug_report_model.py: BoringModel on RandomDataset,
``trainer.fit`` then ``trainer.test``) on distkit's engines, converted as docs/integrations.md says.

The template's ``run()`` is kept as it is except for the marked lines: a parser with distkit's flags and the
strategy (4 lines), a seed so that the ranks draw the same random data (1 line),
``strategy=strategy, accelerator="cpu", devices=2`` in the Trainer (1 line), and an ``--out`` file with
the results (what tests/test_lightning.py checks). Its two classes are imported from ``lightning.pytorch.demos``, where
Lightning ships the same BoringModel (one ``Linear(32, 2)``, SGD lr 0.1) and RandomDataset; validation/test log their
loss with ``sync_dist=True``.

    python examples/lightning_boring.py                                        # Lightning starts 2 ranks (ddp)
    python examples/lightning_boring.py --nprocs 2 ++distributed.backend mpi   # distkit starts them under mpirun
    python examples/lightning_boring.py --nprocs 2 ++distributed.backend horovod
    python examples/lightning_boring.py --nprocs 2 ++distributed.reduce_type param ++distributed.param_sync_step 2
    torchrun --nproc_per_node 2 examples/lightning_boring.py
    mpirun -np 2 python examples/lightning_boring.py ++distributed.backend mpi
"""
import argparse  # distkit
import json  # distkit: --out
import os

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel as _Boring, RandomDataset
from torch.utils.data import DataLoader

import distkit  # distkit
from distkit.lightning import DistkitStrategy  # distkit


class BoringModel(_Boring):
    """Lightning's BoringModel, its validation and test losses logged (mean over every rank's samples)."""

    def validation_step(self, batch, batch_idx):
        self.log("valid_loss", self.step(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.step(batch), sync_dist=True)


def run():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])  # distkit
    parser.add_argument("--out", default=None, help="write the test loss and final weights here (JSON)")  # distkit
    args = distkit.add_arguments(parser).parse_args()  # distkit: --config, ++key value, --nprocs
    strategy = DistkitStrategy(args)  # distkit: under --nprocs N this starts the N ranks
    seed_everything(42)  # distkit: every rank draws the same RandomDataset (the template draws unseeded)

    train_data = DataLoader(RandomDataset(32, 64), batch_size=2)
    val_data = DataLoader(RandomDataset(32, 64), batch_size=2)
    test_data = DataLoader(RandomDataset(32, 64), batch_size=2)

    model = BoringModel()
    trainer = Trainer(
        default_root_dir=os.getcwd(),
        limit_train_batches=1,
        limit_val_batches=1,
        limit_test_batches=1,
        num_sanity_val_steps=0,
        max_epochs=1,
        enable_model_summary=False,
        strategy=strategy, accelerator="cpu", devices=2,  # distkit
    )
    trainer.fit(model, train_dataloaders=train_data, val_dataloaders=val_data)
    result = trainer.test(model, dataloaders=test_data)
    if args.out and trainer.is_global_zero:  # distkit: what the test checks
        with open(args.out, "w") as f:
            json.dump({"test_loss": result[0]["test_loss"], "engine": strategy.dk.backend,
                       "mode": strategy.dk.cfg.distributed.reduce_type, "world_size": trainer.world_size,
                       "weight": model.layer.weight.tolist(), "bias": model.layer.bias.tolist(),
                       "test_batches": [test_data.dataset[i].tolist() for i in range(4)]}, f)


if __name__ == "__main__":
    run()
