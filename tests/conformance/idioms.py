"""The conformance script: everyday idioms of real training scripts, run in a row on one engine.

Each idiom ("phase") takes a few optimizer steps on one small model, the way nanoGPT, a Hugging Face
classifier or a pytorch/examples CNN writes it; after each phase every rank records its state
(parameters, learning rates, an EMA copy) or the error the phase raised, into ``OUT/rank-R.pt``.
``tests/test_conformance.py`` runs it on every engine and mode and compares each phase with DDP's
(or with plain PyTorch for one process), or checks the documented error. ``--plain`` runs the same
phases without distkit at all (one process: the reference for a one-process run).

The model: Linear-BatchNorm-LayerNorm-Linear, a frozen Linear (requires_grad False), and with ``--unused`` a
Linear that forward never uses. AdamW with two param groups chosen by name (weight decay 0.1 for
matrices, 0 for biases and the norm: Hugging Face's grouping), or with ``--optimizer muon`` what ``optimizer =
{"class": "muon"}`` builds (:func:`distkit.components.build_muon`: torch's Muon on the 2-D matrices, AdamW on the
rest), and a StepLR schedule (a scheduler object, or a factory with ``--scheduler factory``). Every rank draws its
own batches from a seed of (phase, step, micro-step, rank), so every engine sees the same data.

A phase that raises a DistkitError (an idiom an engine refuses with a message) is recorded with
that message; the step in progress is completed, and the next phases run on (their states then no
longer compare with DDP's: the suite puts such idioms last).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_  # bound before distkit.init, as scripts often do

STEPS = 2  # optimizer steps per phase
BATCH = 8  # samples per rank per micro-step


class Net(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        # no bias before BatchNorm (resnet's habit): BatchNorm cancels it, its gradient is rounding noise that Adam
        # scales up to full steps, and two engines' rounding would then part by 2e-3
        self.fc1 = nn.Linear(16, 32, bias=False)
        self.bn = nn.BatchNorm1d(32)  # buffers: running statistics, updated by every training forward
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.extra = nn.Linear(4, 4) if unused else None

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = self.frozen(self.fc2(torch.tanh(self.norm(self.bn(self.fc1(x))))))
        return h + self.extra(h) if use_extra else h  # (--unused: a branch some steps take on some ranks)


def batch(phase: int, step: int, micro: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_000 * phase + 1000 * step + 10 * micro + rank)
    return torch.randn(BATCH, 16, generator=g).to(device), torch.randint(0, 4, (BATCH,), generator=g).to(device)


def param_groups(named: Any) -> list[dict[str, Any]]:
    """Hugging Face's grouping by name: no weight decay for biases and the norm."""
    decay, no_decay = [], []
    for n, p in named:
        if p.requires_grad:
            (no_decay if n.endswith("bias") or n.startswith("norm.") else decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


class Runner:
    """The loop state the phases share: the session (or None for --plain), model, optimizer, scheduler."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.plain = args.plain
        if self.plain:
            self.dk: Any = None
            self.rank, self.world, self.device = 0, 1, torch.device("cpu")
        else:
            import distkit

            self.dk = distkit.init(args)
            if args.accum_api:
                self.dk.set_accumulation(args.accum_api)  # the nanoGPT way: once the world size is known
            self.rank, self.world, self.device = self.dk.rank, self.dk.world_size, self.dk.device
        self.accum = args.accum_api or (self.dk.accumulation if self.dk is not None else 1)
        torch.manual_seed(1234)  # the same initial model with and without distkit (init seeds with its own seed)
        model: nn.Module = Net(unused=args.unused)
        self.named_names = [n for n, _ in model.named_parameters()]
        optimizer = (_muon(model) if args.optimizer == "muon"
                     else torch.optim.AdamW(param_groups(model.named_parameters()), lr=0.02))
        if args.compile:
            model = torch.compile(model, backend="eager")  # type: ignore[assignment]
        factory = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)  # noqa: E731
        if self.plain:
            self.model, self.optimizer, self.scheduler = model, optimizer, factory(optimizer)
        elif args.scheduler == "factory":
            self.model, self.optimizer, self.scheduler = self.dk.setup(model, optimizer, factory)
        else:
            self.model, self.optimizer, self.scheduler = self.dk.setup(model, optimizer, factory(optimizer))
        self.ema: Any = None
        self.extra: dict[str, Any] = {}  # what a phase records besides the state
        #: the next state() gathers ZeRO-3's partitioned parameters (set by a phase after which every rank holds every
        #: parameter partitioned: ``synced``, after dk.finish; elsewhere a rank may hold one whole that another does
        #: not, e.g. a module only some ranks ran, and a gather on one rank only would wait forever)
        self.gather_zero3 = False
        self.phase = 0
        self.pending = False  # a backward ran since the last step

    # -- the loop's primitives, with and without distkit ------------------------------------------
    def bare(self) -> nn.Module:
        return self.model if self.dk is None else self.dk.unwrap(self.model)

    def loss(self, step: int, micro: int, use_extra: bool = False) -> torch.Tensor:
        x, y = batch(self.phase, step, micro, self.rank + self.args.rank_offset, self.device)
        return nn.functional.cross_entropy(self.model(x, use_extra=use_extra) if use_extra else self.model(x), y)

    def backward(self, loss: torch.Tensor) -> None:
        self.pending = True
        if self.dk is None:
            loss.backward()
        else:
            self.dk.backward(loss)

    def step(self) -> None:
        self.pending = False
        if self.dk is None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        else:
            self.dk.step()
        if self.ema is not None:
            self.ema.update_parameters(self.bare())

    def no_sync(self) -> Any:
        import contextlib

        return contextlib.nullcontext() if self.dk is None else self.dk.no_sync()

    def micro_steps(self, step: int, use_no_sync: bool = True) -> None:
        """One step's ``accum`` backward passes, each loss divided by ``accum``; the first ``accum - 1``
        inside no_sync (or all outside it, nanoGPT's ``require_backward_grad_sync`` habit left out)."""
        for m in range(self.accum):
            last = m == self.accum - 1
            with self.no_sync() if use_no_sync and not last else _null():
                self.backward(self.loss(step, m) / self.accum)

    def state(self) -> dict[str, Any]:
        bare = self.bare()
        # (a sharded parameter, FSDP2's DTensor, gathered whole: a collective every rank runs in the same order)
        zero3, self.gather_zero3 = self.gather_zero3, False
        out: dict[str, Any] = {"params": {n: _whole(p, zero3).cpu().clone().float() for n, p in bare.named_parameters()},
                               "lrs": [g["lr"] for g in self.optimizer.param_groups],
                               # each rank's own: DDP leaves the statistics of a rank's last forward on it
                               "buffers": {n: b.detach().cpu().clone().double() for n, b in bare.named_buffers()}}
        if self.ema is not None:
            out["ema"] = {n: _whole(p).cpu().clone() for n, p in self.ema.module.named_parameters()}
        out.update(self.extra)
        self.extra = {}
        return out


def _muon(model: nn.Module) -> torch.optim.Optimizer:
    """MuLoCo's inner optimizer for ``model``'s trainable parameters, as ``optimizer = {"class": "muon"}`` builds it
    (learning rate 0.02: Muon's, and AdamW's by default)."""
    from distkit.components import build_muon

    trainable = lambda: [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # noqa: E731
    return build_muon({}, [p for _, p in trainable()], lr=0.02, named_parameters=trainable)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# -- the phases ---------------------------------------------------------------------------------------
def plain(r: Runner) -> None:
    """The loop as written: backward (with no_sync micro-steps when accumulating), step."""
    for s in range(STEPS):
        r.micro_steps(s)
        r.step()


def synced(r: Runner) -> None:
    """The loop as written, then ``dk.finish()`` (param mode: the final sync, after which every replica holds the
    same model, bit for bit: ``ranks_in_sync``); the parameters recorded are the synced ones, with the bytes per sync
    this rank handed to the engine's collectives since the start (param mode's averager: what distkit's Trainer
    logs as ``sync_bytes`` / ``syncs``)."""
    plain(r)
    if r.dk is not None:
        r.dk.finish()
        r.extra["ranks_in_sync"] = r.dk.summary()["ranks_in_sync"]
        averager = r.dk._strategy.averager  # (the engine's own: instrumentation, not an idiom)
        r.extra["bytes_per_sync"] = averager.bytes_per_sync if averager is not None else None
        r.gather_zero3 = True  # (ZeRO-3: dk.finish left every parameter partitioned, on every rank)


def accumulate_without_no_sync(r: Runner) -> None:
    """Every micro-step's backward outside no_sync (DDP reduces each time; the sum is the same)."""
    for s in range(STEPS):
        r.micro_steps(s, use_no_sync=False)
        r.step()


def double_backward(r: Runner) -> None:
    """Two backward passes per step with accumulation left at 1 (nanoGPT without its sync flag)."""
    for s in range(STEPS):
        r.backward(r.loss(s, 0) / 2)
        r.backward(r.loss(s, 1) / 2)
        r.step()


def zero_grad_set_to_none(r: Runner) -> None:
    """``optimizer.zero_grad(set_to_none=True)`` before each backward, the standard PyTorch idiom."""
    for s in range(STEPS):
        r.optimizer.zero_grad(set_to_none=True)
        r.micro_steps(s)
        r.step()


def raw_clip(r: Runner) -> None:
    """``clip_grad_norm_(model.parameters(), 0.05)`` kept from the original script (it clips: the gradient norm
    here is about 1), with the name bound at import, before ``distkit.init``."""
    for s in range(STEPS):
        r.micro_steps(s)
        clip_grad_norm_(r.model.parameters(), 0.05)
        r.step()


def save_load(r: Runner) -> None:
    """``dk.save`` then ``dk.load`` (a resume) in the middle of the LR schedule, then more steps: the
    scheduler must go on setting the learning rate the engine steps with."""
    plain(r)
    if r.dk is not None:
        path = os.path.join(r.args.out, "ckpt")
        state = {"model": r.model, "optimizer": r.optimizer, "scheduler": r.scheduler}
        r.dk.save(path, state)
        r.dk.load(path, state)
    r.phase += 1000
    plain(r)


def ema(r: Runner) -> None:
    """An EMA copy (``torch.optim.swa_utils.AveragedModel``), registered with ``dk.keep_in_sync``."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    r.ema = AveragedModel(r.bare(), multi_avg_fn=get_ema_multi_avg_fn(0.9))
    if r.dk is not None:
        r.dk.keep_in_sync(r.ema)
    plain(r)
    if r.dk is not None:
        r.dk.finish()  # param mode: the final sync averages the model and the EMA
        r.extra["ema_in_sync"] = r.dk.summary()["ranks_in_sync"]
        with torch.no_grad():  # ranks_in_sync must see an EMA that differs on one rank
            first = next(r.ema.module.parameters())
            kept = first.clone()
            first.add_(1.0 if r.rank == 1 else 0.0)
            r.extra["ema_off_in_sync"] = r.dk.summary()["ranks_in_sync"]
            first.copy_(kept)
            # ... and a count that differs on one rank (a tensor every engine holds whole on every rank)
            r.ema.n_averaged.add_(1 if r.rank == 1 else 0)
            r.extra["ema_count_off_in_sync"] = r.dk.summary()["ranks_in_sync"]
            r.ema.n_averaged.sub_(1 if r.rank == 1 else 0)


def eval_between_steps(r: Runner) -> None:
    """pytorch/examples imagenet's ``validate()`` between training steps: ``model.eval()``, forwards under
    ``torch.no_grad()``, ``model.train()``. Each rank evaluates its own batches; the outputs are recorded. DDP
    gives the first evaluation forward rank 0's BatchNorm statistics (the forward before it trained) and the
    second, and the next training forward, none (the forward before each was under no_grad)."""
    outputs = []
    for s in range(STEPS):
        r.micro_steps(s)
        r.step()
        r.model.eval()
        with torch.no_grad():
            for k in range(2):
                x, _ = batch(r.phase, 100 + s, k, r.rank, r.device)
                outputs.append(r.model(x).double().sum().item())
        r.model.train()
    r.extra["eval"] = outputs


def eval_gather(r: Runner) -> None:
    """Accelerate's evaluation: a loader that keeps the incomplete last batch (``drop_last=False``; 21 samples, 2
    ranks x 4: the last global batch of 5 is padded to 6) and ``dk.gather`` of each batch's inputs and labels
    (``gather_for_metrics``). Every sample once, in the loader's global order, on every rank."""
    if r.dk is None:
        return
    data = [(torch.full((2,), float(i)), i) for i in range(21)]
    ids: list[int] = []
    for x, y in r.dk.dataloader(data, batch_size=4, drop_last=False):
        gx, gy = r.dk.gather((x, y))
        assert gx[:, 0].long().tolist() == gy.tolist()
        ids += gy.tolist()
    # the DataLoader a script already has, re-sharded (its drop_last=False carried over: every sample once)
    resharded: list[int] = []
    for _, y in r.dk.dataloader(torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)):
        resharded += r.dk.gather(y).tolist()
    # an evaluation loss the exact way (docs/api.md): per-sample losses gathered, their mean over the set; a
    # per-batch mean repeated (losses.append(gather(loss.repeat(n)))) would count the padded copies of the last batch
    per_sample: list[torch.Tensor] = []
    for x, y in r.dk.dataloader(data, batch_size=4, drop_last=False, shuffle=False):
        per_sample.append(r.dk.gather((x[:, 0] - y.double() * 0.5) ** 2))  # one loss per sample
    r.extra["eval"] = [float(i) for i in ids] + [torch.cat(per_sample).mean().item()]
    r.extra["gathered"] = ids
    r.extra["resharded"] = resharded


def module_attribute(r: Runner) -> None:
    """``model.module`` (DDP's wrapper attribute), then ``dk.unwrap(model)`` (every engine)."""
    try:
        inner = r.model.module
    except AttributeError as e:  # the message names the fix (dk.unwrap) where the model is not wrapped
        raise RuntimeError(str(e)) from None
    assert inner is not None


def print_flush(r: Runner) -> None:
    """``dk.print(..., flush=True)``, as scripts call print."""
    if r.dk is not None:
        r.dk.print("conformance: print with flush", flush=True)


def some_ranks(r: Runner) -> None:
    """A module some ranks run and others not in the same step (``--unused``'s Linear, on rank (step % 2) only: a
    branch on the data, layer drop), with ``find_unused_parameters``: DDP averages its gradient with zeros from the
    ranks that did not run it."""
    for s in range(STEPS):
        r.backward(r.loss(s, 0, use_extra=(s + r.rank + r.args.rank_offset) % 2 == 0))
        r.step()


def drop_last(r: Runner) -> None:
    """``dk.dataloader(..., drop_last=True)`` (what DataLoader users write), and ``dk.print(..., flush=True)``."""
    if r.dk is None:
        return
    r.dk.print("conformance: print with flush", flush=True)
    data = torch.utils.data.TensorDataset(torch.arange(40.0).reshape(20, 2))
    assert len(r.dk.dataloader(data, batch_size=4, drop_last=True)) == 20 // (4 * r.world)


def distributed_sampler(r: Runner) -> None:
    """A kept ``torch.utils.data.DistributedSampler(dataset)`` (no num_replicas): works where
    torch.distributed runs; elsewhere the process must stop with one line naming the fix (uncaught:
    this phase is last, and its error goes through distkit's exception hook)."""
    data = torch.utils.data.TensorDataset(torch.arange(40.0).reshape(20, 2))
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
    assert len(list(sampler)) == 20 // r.world


PHASES: dict[str, Callable[[Runner], None]] = {f.__name__: f for f in (
    plain, synced, accumulate_without_no_sync, double_backward, zero_grad_set_to_none, raw_clip, save_load, ema,
    some_ranks, eval_between_steps, eval_gather, module_attribute, print_flush, drop_last, distributed_sampler)}
#: phases whose exception is left to distkit's exception hook (the process ends there)
UNCAUGHT = {"distributed_sampler"}


def parse(argv: list[str]) -> argparse.Namespace:
    """The script's arguments (and distkit's, unless ``--plain``) from ``argv``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--phases", required=True, help="comma-separated, run in this order")
    parser.add_argument("--unused", action="store_true", help="add a parameter forward never uses")
    parser.add_argument("--compile", action="store_true", help="torch.compile(model, backend='eager') before setup")
    parser.add_argument("--scheduler", choices=["object", "factory"], default="object")
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                        help="muon: what optimizer = {'class': 'muon'} builds (Muon: the matrices; AdamW: the rest)")
    parser.add_argument("--accum-api", type=int, default=0, help="dk.set_accumulation(N) after init")
    parser.add_argument("--plain", action="store_true", help="no distkit: plain PyTorch, one process")
    parser.add_argument("--rank-offset", type=int, default=0,
                        help="draw the batches of rank r + N (a fault-tolerant group i of 1 rank: N = i, the batches "
                             "rank i takes in one job of the groups)")
    args, rest = parser.parse_known_args(argv)
    if not args.plain:
        import distkit

        distkit.add_arguments(parser)
        args = parser.parse_args(argv)
    unknown = [p for p in args.phases.split(",") if p not in PHASES]
    if unknown:
        parser.error(f"unknown phases {unknown}; known: {sorted(PHASES)}")
    return args


def run_kind(args: argparse.Namespace) -> None:
    """One run: a session (``distkit.init``; under ``--nprocs`` in the launching process, the relaunch as the ranks,
    which does not return), the phases in order, each rank's record in ``OUT/rank-R.pt``, ``dk.finish`` and
    ``dk.close``."""
    phases = args.phases.split(",")
    os.makedirs(args.out, exist_ok=True)
    r = Runner(args)
    record: dict[str, Any] = {"world_size": r.world, "phases": {}}
    path = os.path.join(args.out, f"rank-{r.rank}.pt")
    for i, name in enumerate(phases):
        r.phase = i + 1
        error = None
        if name in UNCAUGHT:
            _save(record, path)  # what ran so far, before the process may end here
            if r.dk is not None:
                # every rank's record is on disk before any rank may end the job here: a rank that ran ahead (param
                # mode has no per-step collective) aborted the others, on Horovod, before rank 0 recorded raw_clip
                r.dk.barrier()
            PHASES[name](r)
        else:
            from distkit.errors import DistkitError

            try:
                PHASES[name](r)
            except (DistkitError, RuntimeError) as e:
                error = f"{type(e).__name__}: {e}"
                if r.pending and isinstance(e, DistkitError) and i < len(phases) - 1:
                    # The engine refused before the step (on every rank alike): complete the step and go on
                    # (the next phases' states no longer compare with DDP's). Where the step refuses too,
                    # the error ends the process (exit 2, one line): the refusal is not recoverable. After the
                    # last phase nothing goes on (DeepSpeed's step after a backward it refused fails in itself).
                    r.step()
        record["phases"][name] = {"error": error, **r.state()}
        _save(record, path)
    record["mlflow_ran"] = "mlflow.version" in sys.modules  # DeepSpeed imports it; distkit defers it (unused here)
    if r.dk is not None:
        r.dk.finish()  # param mode: the final sync, after which ranks_in_sync must hold
        summary = r.dk.summary()
        record["ranks_in_sync"] = summary["ranks_in_sync"]
        _save(record, path)
        r.dk.close()
    sys.stdout.flush()


def main() -> None:
    """One run from the command line, or with ``--chain SPEC`` several runs one after another in the same processes
    (SPEC: a JSON list of argument lists, each a whole command line of one run, ``--nprocs`` and the engine alike in
    all): one process start (and one import of torch, the engine and distkit per rank) for a run kind each, which
    tests/test_conformance.py pays once per engine and mode. Each run is a session of its own (``distkit.init`` to
    ``dk.close``), with its own ``--out``: what it records is what the same command line alone records (checked by
    ``test_conformance.py::test_a_chained_run_records_what_it_records_alone``). A run that ends the process (an
    uncaught documented error) leaves the runs after it unrecorded: the suite orders those last."""
    if len(sys.argv) == 3 and sys.argv[1] == "--chain":
        import json

        with open(sys.argv[2]) as f:
            chain = json.load(f)
        for argv in chain:
            run_kind(parse(argv))
        return
    run_kind(parse(sys.argv[1:]))


def _whole(t: torch.Tensor, zero3: bool = False) -> torch.Tensor:
    """A parameter detached and whole: a DTensor (the fsdp engine's) gathered; with ``zero3``, a ZeRO-3 parameter
    that is partitioned now (after ``dk.finish()``; this small model's are held whole between steps) gathered for the
    copy and partitioned again (collective: the caller makes sure that every rank holds it in the same state, and
    records the parameters in the same order); a plain tensor as it is."""
    if hasattr(t, "full_tensor"):
        return t.detach().full_tensor()  # type: ignore[no-any-return]
    if zero3 and hasattr(t, "ds_id"):
        import deepspeed  # type: ignore[import-untyped]
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # type: ignore[import-untyped]

        if t.ds_status == ZeroParamStatus.NOT_AVAILABLE:  # (gathering an available one would partition it after)
            with deepspeed.zero.GatheredParameters([t], modifier_rank=None):
                return t.detach().clone()
    return t.detach()


def _save(record: dict[str, Any], path: str) -> None:
    """Replace the rank's record whole (a reader never sees half of one: a process ended mid-save leaves the last
    complete record, whose missing phases the test then names)."""
    torch.save(record, path + ".tmp")
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
