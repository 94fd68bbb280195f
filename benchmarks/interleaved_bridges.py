"""The bridges against the framework's own way, in the same processes: blocks of steps, alternating (issue 61 item 2).

    python benchmarks/interleaved_bridges.py --bridge fabric|lightning|paramsync|trainer [--pairs 60] [--block 10]
                                             [--aa] [--size small|medium] [--local-sgd-steps 5] [--pin] [--out PATH]

``--bridge fabric``: one ``torchrun --standalone`` job of ``--nprocs`` ranks; each rank holds two Lightning Fabric
objects on the same process group, each with its own copy of the ``charlm`` workload: side A ``Fabric(strategy="ddp")``
(Fabric's own DDP over gloo), side B ``Fabric(strategy=DistkitStrategy({"distributed": {"backend": "ddp", ...}}))``
(distkit's ddp engine under Fabric: ``dk.setup`` in ``fabric.setup``, ``dk.backward`` in ``fabric.backward``,
``dk.step`` in ``optimizer.step``). Both run the same user code per step (``optimizer.zero_grad()``, forward,
``fabric.backward(loss)``, ``optimizer.step()``) on the same batches (``workload.shard_batches``: the ``shard`` order
on both, so the data loader is not what is compared), plain SGD, the same seed, the same DDP ``bucket_cap_mb``;
at the end both models' parameters must be equal (``param_checksum``), and equal on every rank, else the script
fails. Fabric's own parity test runs Fabric and raw torch side by side in one process pair the same way.

``--bridge paramsync``: the same job shape; each rank holds one ``Accelerator(cpu=True)`` (MULTI_CPU over gloo) and
two models it prepared (DDP wrappers, SGD), each trained inside its own block for the whole job: side A
``accelerate.local_sgd.LocalSGD(accelerator, model, local_sgd_steps=K)`` (Accelerate's own), side B
``distkit.hf.ParamSync(accelerator, model, local_sgd_steps=K)`` (distkit's, at LocalSGD's settings: its sync is
LocalSGD's op for op). Per step both run the same user code (forward, ``accelerator.backward``, ``optimizer.step()``,
``optimizer.zero_grad()``, ``sync.step()``); each rank trains on its own batches (the ``shard`` order) and the
parameters are averaged every K steps. ``--block`` must be a multiple of K, so every block holds the same number
of syncs on both sides. Leaving the blocks syncs both; then the parameters must be equal.

``--bridge lightning`` and ``--bridge trainer``: a framework that owns its loop (``Trainer.fit``, ``Trainer.train``)
cannot be stepped from outside, so two copies cannot alternate in one thread. Side A's loop runs in a thread of its
own, paused before every step it has not been granted (``threaded_side.py``); side B's loop runs in the main thread,
and a callback at the start of each of its steps drives the schedule, granting A its blocks: one loop runs at a time,
one hand-over each way per A block (the A/A run shows what that costs). ``lightning``: side A
``Trainer(strategy=DDPStrategy())``, side B ``Trainer(strategy=DistkitStrategy({ddp engine}))``, the same
LightningModule (its step calls ``self.model(x)``, as Lightning's templates) on this rank's ``shard``-order batches
(``use_distributed_sampler=False``), SGD; ``trainer``: side A the stock ``transformers.Trainer`` (Accelerate's DDP),
side B ``distkit.hf.DistkitTrainer`` (the ddp engine, grad mode), both with the Trainer's own sampler and collator,
SGD at a constant rate, no clipping. Both must end with the same parameters, as above.

The schedule and statistics are ``interleaved.py``'s: ABBA blocks of ``--block`` steps (:class:`interleaved.Alternator`
driven by side B's steps), a pair's ratio is B's block time over A's, wall (``perf_counter`` seconds) and rank 0's
CPU (``process_time`` seconds); the first ``--warmup-pairs`` pairs are left out; the median of the per-pair ratios
with its 95 % bootstrap interval. ``--aa``: side B is a second copy of side A (``Fabric(strategy="ddp")``,
``LocalSGD``, ``DDPStrategy``, the stock Trainer): what the method resolves for this pair of frameworks. Writes
``interleaved_bridge_<bridge>[_aa].json`` into a fresh temp directory (or ``--out``) and prints a summary line, then
the path. Each job has ``--run-timeout`` seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import interleaved  # noqa: E402  (the schedule, the per-pair ratios, the statistics, the threads' CPU)
import overhead  # noqa: E402  (the launcher, the environment, the runner, the load record)
from workload import launcher_rank, pin_rank, seeded_charlm, shard_batches  # noqa: E402

WORKER = "--worker"
BRIDGES = ("fabric", "lightning", "paramsync", "trainer")


# --------------------------------------------------------------------------- per rank
def fabric_side(strategy: Any, args: argparse.Namespace, rank: int, world: int) -> tuple[Callable[[int], Any],
                                                                                        Callable[[], str]]:
    """One Fabric with ``strategy`` and its own copy of the workload: (``step(i)``: optimizer step ``i`` the way a
    Fabric script writes it, returning the loss; ``checksum()``: ``param_checksum`` of the bare model). Built
    without touching the process's random state beyond the model's own seed."""
    import torch
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    from distkit.evaluation import param_checksum

    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world, precision="32-true")
    fabric.launch()  # (under torchrun: no processes started; the process group joined once)
    with torch.random.fork_rng(devices=[]):
        train, bare = seeded_charlm(args)
        model, optimizer = fabric.setup(bare, torch.optim.SGD(bare.parameters(), lr=args.lr))
    batch = shard_batches(*train.tensors, args.seed, args.batch_size, rank, world)

    def step(i: int) -> torch.Tensor:
        x, y = batch(i)
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        return loss

    return step, lambda: param_checksum(bare.named_parameters())


def ranks_agree(checksums: tuple[str, str]) -> bool:
    """Collective (every rank, torch.distributed's default group): whether every rank holds the same two checksums
    (side A's, side B's): each side's ranks ended with one model (Fabric's DDP; LocalSGD's and ParamSync's final
    average)."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, list(checksums))
    return all(c == every[0] for c in every)


def accelerate_side(accelerator: Any, sync_class: Any, args: argparse.Namespace, rank: int,
                    world: int) -> tuple[Callable[[int], Any], Callable[[], str], Any]:
    """One model prepared by ``accelerator`` with its own SGD, trained inside ``sync_class(accelerator, model,
    local_sgd_steps=K)`` (``LocalSGD`` or ``ParamSync``): (``step(i)``: a LocalSGD script's step ``i``, returning the
    loss; ``checksum()``: ``param_checksum`` of the bare model; the sync object, whose block the caller enters)."""
    import torch
    import torch.nn.functional as F

    from distkit.evaluation import param_checksum

    with torch.random.fork_rng(devices=[]):
        train, bare = seeded_charlm(args)
        model, optimizer = accelerator.prepare(bare, torch.optim.SGD(bare.parameters(), lr=args.lr))
    sync = sync_class(accelerator, model, local_sgd_steps=args.local_sgd_steps)
    batch = shard_batches(*train.tensors, args.seed, args.batch_size, rank, world)

    def step(i: int) -> torch.Tensor:
        x, y = batch(i)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        sync.step()
        return loss

    return step, lambda: param_checksum(bare.named_parameters()), sync


def paramsync_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of ``--bridge paramsync``: side B's steps driving an :class:`interleaved.Alternator` over side A,
    both inside their sync blocks; rank 0's record."""
    from accelerate import Accelerator
    from accelerate.local_sgd import LocalSGD

    from distkit.hf import ParamSync

    args = argparse.Namespace(**spec["workload"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    accelerator = Accelerator(cpu=True)
    step_a, sum_a, sync_a = accelerate_side(accelerator, LocalSGD, args, rank, world)
    step_b, sum_b, sync_b = accelerate_side(accelerator, LocalSGD if spec["mode"] == "aa" else ParamSync, args, rank,
                                            world)
    alt = interleaved.Alternator(spec["pairs"], spec["block"], step_a)
    with sync_a, sync_b:  # (leaving: A's sync, then B's, on every rank)
        for i in range(alt.b_total):
            alt.tick()
            step_b(i)
    sums = (sum_a(), sum_b())
    return {"background_cpu_s": interleaved.background_cpu(), "a_checksum": sums[0], "b_checksum": sums[1],
            "ranks_agree": ranks_agree(sums), "engine": f"accelerate {accelerator.distributed_type}", "alt": alt}


def trainer_side(strategy: Any, args: argparse.Namespace, rank: int, world: int, steps: int,
                 before_step: Callable[[], None]) -> tuple[Callable[[], Any], Callable[[], str]]:
    """A Lightning ``Trainer`` with ``strategy`` and its own copy of the workload: (``fit()``: ``steps`` optimizer
    steps, ``before_step()`` called at the start of each (a callback's ``on_train_batch_start``); ``checksum()``:
    ``param_checksum`` of the bare model). The LightningModule's step calls the model as Lightning's templates do
    (``self.model(x)``); its loader hands out this rank's batches in the ``shard`` order (no sampler of Lightning's:
    ``use_distributed_sampler=False``), so the data is not what is compared."""
    import torch
    import torch.nn.functional as F
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch.utils.data import DataLoader, Dataset

    from distkit.evaluation import param_checksum

    with torch.random.fork_rng(devices=[]):
        train, bare = seeded_charlm(args)
    batch = shard_batches(*train.tensors, args.seed, args.batch_size, rank, world)

    class Batches(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return steps

        def __getitem__(self, i: int) -> Any:
            return batch(i)

    class CharLM(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = bare

        def training_step(self, xy: Any, i: int) -> torch.Tensor:
            x, y = xy
            logits = self.model(x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=args.lr)

    class BeforeStep(Callback):
        def on_train_batch_start(self, *_: Any) -> None:
            before_step()

    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=world, precision="32-true", max_epochs=1,
                      max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                      limit_val_batches=0, callbacks=[BeforeStep()])
    module = CharLM()

    def fit() -> None:
        trainer.fit(module, DataLoader(Batches(), batch_size=None, shuffle=False))

    return fit, lambda: param_checksum(bare.named_parameters())


def lightning_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of ``--bridge lightning``: side A (``DDPStrategy``) fits in a thread of its own
    (:class:`threaded_side.ThreadedLoop`), side B (``DistkitStrategy``, or a second ``DDPStrategy`` for ``--aa``) in
    the main thread, its steps driving the :class:`interleaved.Alternator` that grants A its blocks."""
    from lightning.pytorch.strategies import DDPStrategy

    from distkit.lightning import DistkitStrategy
    from threaded_side import ThreadedLoop

    args = argparse.Namespace(**spec["workload"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    holder: dict[str, Any] = {}
    side_a = ThreadedLoop(lambda before: holder["fit_a"](), name="side-a-ddpstrategy")
    alt = interleaved.Alternator(spec["pairs"], spec["block"], lambda i: side_a.run_block(1), side_a.run_block)
    ddp = {"process_group_backend": "gloo", "bucket_cap_mb": args.bucket_cap_mb}
    holder["fit_a"], sum_a = trainer_side(DDPStrategy(**ddp), args, rank, world, alt.b_total, side_a.before_step)
    side_a.start()  # (A's set-up first, on every rank: it starts the process group B's strategy then joins)
    strategy = (DDPStrategy(**ddp) if spec["mode"] == "aa" else
                DistkitStrategy({"device": "cpu", "distributed": {
                    "backend": "ddp", "reduce_type": "grad", "pg_backend": "gloo",
                    "options": {"bucket_cap_mb": args.bucket_cap_mb}}}))
    fit_b, sum_b = trainer_side(strategy, args, rank, world, alt.b_total, alt.tick)
    fit_b()
    side_a.join()
    sums = (sum_a(), sum_b())
    result = {"background_cpu_s": interleaved.background_cpu(), "a_checksum": sums[0], "b_checksum": sums[1],
              "ranks_agree": ranks_agree(sums), "alt": alt}
    if spec["mode"] != "aa":
        result["engine"] = strategy.dk.backend
        strategy.close()
    return result


def hf_side(trainer_class: Any, args: argparse.Namespace, steps: int, before_step: Callable[[], None], out: str,
            **extra: Any) -> tuple[Callable[[], Any], Callable[[], str]]:
    """A ``transformers.Trainer`` (``trainer_class``: the stock one or ``DistkitTrainer``, with ``extra``) and its own
    copy of the workload: (``train()``: ``steps`` optimizer steps, ``before_step()`` at the start of each (a
    callback's ``on_step_begin``); ``checksum()``: ``param_checksum`` of the bare model). The Trainer's own data
    pipeline (its sampler and collator) on both sides: the same batches; SGD at a constant rate, no clipping."""
    import torch
    import torch.nn.functional as F
    from transformers import TrainerCallback, TrainingArguments

    from distkit.evaluation import param_checksum

    with torch.random.fork_rng(devices=[]):
        train, bare = seeded_charlm(args)

    class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return len(train)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            x, y = train[i]
            return {"input_ids": x, "labels": y}

    class WithLoss(torch.nn.Module):  # (a model the Trainer trains: forward returns the loss)
        def __init__(self) -> None:
            super().__init__()
            self.model = bare

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.model(input_ids)
            return {"loss": F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))}

    class BeforeStep(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            before_step()

    targs = TrainingArguments(output_dir=out, per_device_train_batch_size=args.batch_size, max_steps=steps,
                              learning_rate=args.lr, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0,
                              weight_decay=0.0, save_strategy="no", logging_strategy="no", report_to=[],
                              disable_tqdm=True, seed=args.seed, data_seed=args.seed, dataloader_drop_last=True,
                              use_cpu=True, ddp_bucket_cap_mb=int(args.bucket_cap_mb), ddp_backend="gloo")
    trainer = trainer_class(model=WithLoss(), args=targs, train_dataset=Rows(), callbacks=[BeforeStep()], **extra)
    return trainer.train, lambda: param_checksum(bare.named_parameters())


def hf_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of ``--bridge trainer``: side A (the stock ``transformers.Trainer``, Accelerate's DDP) trains in a
    thread of its own (:class:`threaded_side.ThreadedLoop`), side B (``DistkitTrainer`` on the ddp engine, or a
    second stock Trainer for ``--aa``) in the main thread, its steps driving the Alternator that grants A its
    blocks."""
    from transformers import Trainer

    from distkit.hf import DistkitTrainer
    from threaded_side import ThreadedLoop

    args = argparse.Namespace(**spec["workload"])
    holder: dict[str, Any] = {}
    side_a = ThreadedLoop(lambda before: holder["train_a"](), name="side-a-trainer")
    alt = interleaved.Alternator(spec["pairs"], spec["block"], lambda i: side_a.run_block(1), side_a.run_block)
    work = os.path.dirname(spec["times"])
    holder["train_a"], sum_a = hf_side(Trainer, args, alt.b_total, side_a.before_step, os.path.join(work, "a"))
    side_a.start()  # (A's set-up first, on every rank: Accelerate starts the process group distkit then adopts)
    b_class, extra = (Trainer, {}) if spec["mode"] == "aa" else (DistkitTrainer, {"distkit": {"distributed": {
        "backend": "ddp", "reduce_type": "grad", "options": {"bucket_cap_mb": args.bucket_cap_mb}}}})
    train_b, sum_b = hf_side(b_class, args, alt.b_total, alt.tick, os.path.join(work, "b"), **extra)
    train_b()
    side_a.join()
    sums = (sum_a(), sum_b())
    return {"background_cpu_s": interleaved.background_cpu(), "a_checksum": sums[0], "b_checksum": sums[1],
            "ranks_agree": ranks_agree(sums), "alt": alt, "engine": "ddp" if spec["mode"] != "aa" else None}


def worker(spec_path: str) -> int:
    """One rank: side B's steps driving an :class:`interleaved.Alternator` over side A."""
    pin_rank()  # before torch starts its threads
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    if spec["bridge"] != "fabric":
        result = {"paramsync": paramsync_worker, "lightning": lightning_worker, "trainer": hf_worker}[
            spec["bridge"]](spec)
        alt = result.pop("alt")
        if launcher_rank() == 0:
            result.update(blocks=alt.blocks, a_steps=alt.a_step, torch_threads=torch.get_num_threads())
            with open(spec["times"], "w") as f:
                json.dump(result, f)
        return 0
    args = argparse.Namespace(**spec["workload"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from distkit.lightning import DistkitStrategy

    step_a, sum_a = fabric_side("ddp", args, rank, world)
    if spec["mode"] == "aa":
        step_b, sum_b = fabric_side("ddp", args, rank, world)
        strategy = None
    else:
        strategy = DistkitStrategy({"device": "cpu", "distributed": {
            "backend": "ddp", "reduce_type": "grad", "pg_backend": "gloo",
            "options": {"bucket_cap_mb": args.bucket_cap_mb}}})
        step_b, sum_b = fabric_side(strategy, args, rank, world)
    alt = interleaved.Alternator(spec["pairs"], spec["block"], step_a)
    for i in range(alt.b_total):
        alt.tick()
        step_b(i)
    sums = (sum_a(), sum_b())
    result: dict[str, Any] = {"background_cpu_s": interleaved.background_cpu(), "a_checksum": sums[0],
                              "b_checksum": sums[1], "ranks_agree": ranks_agree(sums)}
    if strategy is not None:
        result["engine"] = strategy.dk.backend
        strategy.dk.finish()
        strategy.dk.close()
    if launcher_rank() == 0:
        result.update(blocks=alt.blocks, a_steps=alt.a_step, torch_threads=torch.get_num_threads())
        with open(spec["times"], "w") as f:
            json.dump(result, f)
    return 0


# --------------------------------------------------------------------------- the parent
def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [WORKER]:
        return worker(argv[1])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bridge", default="fabric", choices=BRIDGES)
    ap.add_argument("--aa", action="store_true", help="A/A: the framework's own way against a second copy of itself")
    ap.add_argument("--pairs", type=int, default=60, help="A/B pairs, warm-up pairs included")
    ap.add_argument("--block", type=int, default=10, help="steps per block")
    ap.add_argument("--warmup-pairs", type=int, default=4, help="leading pairs left out of the statistics")
    ap.add_argument("--size", default="small", choices=["small", "medium", "large"])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size on both sides (Fabric's "
                    "default is DDP's 25)")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--local-sgd-steps", type=int, default=5, help="(--bridge paramsync) K: steps between syncs")
    ap.add_argument("--pin", action="store_true", help="each rank bound to its own core (workload.pin_rank)")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per rank (default cores // nprocs)")
    ap.add_argument("--run-timeout", type=float, default=900.0, metavar="SECONDS")
    ap.add_argument("--out", default=None, help="JSON path (default: a fresh directory under the temp directory)")
    args = ap.parse_args(argv)
    if args.pairs <= args.warmup_pairs + 4:
        ap.error("--pairs must exceed --warmup-pairs by at least 5")
    if args.block < 1:
        ap.error("--block must be at least 1")
    if args.bridge == "paramsync" and (args.local_sgd_steps < 1 or args.block % args.local_sgd_steps):
        ap.error("--block must be a multiple of --local-sgd-steps (the same syncs in every block)")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.nprocs)
    mode = "aa" if args.aa else "ab"
    work = tempfile.mkdtemp(prefix="distkit-bridges-")
    times = os.path.join(work, "times.json")
    workload = {k: getattr(args, k) for k in ("size", "seq_len", "batch_size", "lr", "seed", "bucket_cap_mb",
                                              "local_sgd_steps")}
    spec = {"bridge": args.bridge, "mode": mode, "pairs": args.pairs, "block": args.block, "times": times,
            "workload": workload}
    spec_path = os.path.join(work, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = overhead._torchrun(args.nprocs) + [os.path.abspath(__file__), WORKER, spec_path]
    before = overhead.cpu_snapshot()
    t0 = time.perf_counter()
    overhead._run(cmd, overhead._env(args), os.path.join(work, "job.log"), args.run_timeout)
    wall = time.perf_counter() - t0
    load = overhead.foreign_load(before, overhead.cpu_snapshot())
    with open(times) as f:
        rec = json.load(f)
    # the same final parameters on both sides, and on every rank of each side
    same = rec["a_checksum"] == rec["b_checksum"] and rec["ranks_agree"]
    ratios = interleaved.pair_ratios(rec["blocks"], args.warmup_pairs)
    sides = {"fabric": ('Fabric(strategy="ddp")', 'Fabric(strategy=DistkitStrategy(ddp))'),
             "lightning": ("Trainer(strategy=DDPStrategy())", "Trainer(strategy=DistkitStrategy(ddp))"),
             "trainer": ("transformers.Trainer", "distkit.hf.DistkitTrainer(ddp)"),
             "paramsync": ("accelerate LocalSGD", "distkit.hf.ParamSync")}[args.bridge]
    result = {
        "benchmark": "interleaved_bridges", "bridge": args.bridge, "mode": mode,
        "side_a": sides[0], "side_b": sides[0] if args.aa else sides[1], "engine": rec.get("engine"),
        "config": {**workload, "nprocs": args.nprocs, "threads": args.threads, "pairs": args.pairs,
                   "block": args.block, "warmup_pairs": args.warmup_pairs, "pin": args.pin,
                   "launcher": "torchrun --standalone"},
        "command": "python benchmarks/interleaved_bridges.py " + " ".join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": overhead.machine_info(),
        "job_wall_s": wall, "foreign_load_cpus": load, "same_work": same,
        "checksums": [rec["a_checksum"], rec["b_checksum"]], "ranks_agree": rec["ranks_agree"],
        "side_a_steps": rec["a_steps"],
        "pair_ratio": interleaved.summarize(ratios), "pair_ratios": ratios, "blocks": rec["blocks"],
        "background_cpu_s": rec["background_cpu_s"],
        "background_cpu_fraction": sum(rec["background_cpu_s"].values()) / max(wall, 1e-9),
    }
    suffix = "_aa" if args.aa else ""
    out = args.out or os.path.join(tempfile.mkdtemp(prefix="distkit-bridges-results-"),
                                   f"interleaved_bridge_{args.bridge}{suffix}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    r = result["pair_ratio"]
    print(f"interleaved_bridges {args.bridge}{suffix}: {len(ratios['wall'])} pairs of {args.block}-step blocks in "
          f"{wall:.0f} s (foreign load {load:.2f} CPUs): wall {r['wall']['median']:.4f} "
          f"({r['wall']['ci95'][0]:.4f}-{r['wall']['ci95'][1]:.4f}), cpu {r['cpu']['median']:.4f} "
          f"({r['cpu']['ci95'][0]:.4f}-{r['cpu']['ci95'][1]:.4f}); same work: {same}")
    print(out)
    if not same:
        print("interleaved_bridges: the two sides ended with different parameters: they did not run the same work",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
