"""perceptrain's ``Trainer`` on distkit's Session: its own loop, like ``examples/byo_loop.py``.

``fit(train_dataloader)`` under plain ``python`` with ``nprocs > 1`` starts the ranks with
distkit's spawner (``mpirun`` for the mpi and horovod engines), as perceptrain's
``mp.spawn`` does: every rank runs the script up to ``fit`` again, trains, and leaves at the
end of ``fit`` (only the calling process goes on past it); the calling process then loads
rank 0's final model and optimizer state and returns them. Under ``torchrun``, ``mpirun``,
SLURM and the other launchers every rank trains in-process and returns from ``fit``.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import nn
from torch.utils.data import DataLoader

from distkit import portable
from distkit.compat.perceptrain.config import TrainConfig, install_error_hook
from distkit.compat.perceptrain.loss import get_loss
from distkit.compat.perceptrain.optimize_step import DistkitOptimizer, _to
from distkit.compat.perceptrain.optimize_step import optimize_step as default_optimize_step
from distkit.errors import BackendUnavailable, ConfigError, RankFailure, UnsupportedCombination, UsageError

#: set by a parent's fit() for the ranks it starts: the hand-off directory and which fit() call to run
HANDOFF_ENV, FIT_ENV = "DISTKIT_PERCEPTRAIN_HANDOFF", "DISTKIT_PERCEPTRAIN_FIT"


def _scalar(value: Any) -> torch.Tensor:
    return torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value,
                           dtype=torch.float64).cpu().mean()


class Trainer:
    """perceptrain's ``Trainer(model, optimizer, config, loss_fn, train_dataloader, val_dataloader,
    test_dataloader, optimize_step, max_batches)``; ``fit(train_dataloader=None, val_dataloader=None)
    -> (model, optimizer)``. Gradient-based only (``Trainer.set_use_grad(True)``)."""

    _use_grad: bool = True
    #: fit() calls in this process (a rank started by a parent's k-th fit runs its own k-th)
    _fit_calls: int = 0

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], config: TrainConfig,
                 loss_fn: Union[str, Callable, None] = "mse", train_dataloader: Optional[DataLoader] = None,
                 val_dataloader: Optional[DataLoader] = None, test_dataloader: Optional[DataLoader] = None,
                 optimize_step: Callable = default_optimize_step, max_batches: Optional[int] = None) -> None:
        install_error_hook()
        if not isinstance(config, TrainConfig):
            raise UsageError(f"Trainer(..., config=...) needs a distkit.compat.perceptrain.TrainConfig, got "
                             f"{type(config).__name__}")
        if not isinstance(model, nn.Module):
            raise UsageError(f"Trainer(model, ...) needs a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise UnsupportedCombination(
                f"Trainer(..., optimizer={type(optimizer).__name__}): distkit.compat.perceptrain runs torch optimizers "
                "only (gradient-free nevergrad optimization is not supported): pass a torch.optim optimizer")
        if not callable(optimize_step):
            raise UsageError("Trainer(..., optimize_step=...) must be a function like "
                             "distkit.compat.perceptrain.optimize_step.optimize_step")
        if max_batches is not None and (isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1):
            raise ConfigError(f"Trainer(max_batches={max_batches!r}) must be None or an integer >= 1")
        config.validate()
        self.model, self.optimizer, self.config = model, optimizer, config
        self.loss_fn = get_loss(loss_fn)
        self.optimize_step = optimize_step
        self.train_dataloader, self.val_dataloader, self.test_dataloader = train_dataloader, val_dataloader, test_dataloader
        self.max_batches = max_batches
        self.current_epoch, self.global_step = 0, 0
        #: dk.summary() of the last fit (summary.json), on every rank and in the calling process
        self.summary: Optional[dict[str, Any]] = None

    # -- perceptrain's switches ---------------------------------------------------------------------
    @classmethod
    def set_use_grad(cls, value: bool) -> None:
        """perceptrain: True = gradient-based optimization (the only kind distkit runs)."""
        if not isinstance(value, bool):
            raise UsageError(f"Trainer.set_use_grad({value!r}): pass True or False")
        cls._use_grad = value

    @property
    def use_grad(self) -> bool:
        return self._use_grad

    @use_grad.setter
    def use_grad(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise UsageError(f"trainer.use_grad = {value!r}: use True or False")
        self._use_grad = value

    @contextlib.contextmanager
    def enable_grad_opt(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Iterator[None]:
        """perceptrain: gradient-based optimization (optionally with ``optimizer``) inside the block."""
        saved = (self.__dict__.get("_use_grad"), self.optimizer)
        self._use_grad = True
        if optimizer is not None:
            self.optimizer = optimizer
        try:
            yield
        finally:
            if saved[0] is None:
                self.__dict__.pop("_use_grad", None)
            else:
                self._use_grad = saved[0]
            self.optimizer = saved[1]

    # -- fit --------------------------------------------------------------------------------------------
    def fit(self, train_dataloader: Optional[DataLoader] = None,
            val_dataloader: Optional[DataLoader] = None) -> tuple[nn.Module, Any]:
        """Train for ``max_iter`` epochs; returns ``(model, optimizer)``, trained, in the calling process."""
        from distkit.env import detect

        if train_dataloader is not None:
            self.train_dataloader = train_dataloader
        if val_dataloader is not None:
            self.val_dataloader = val_dataloader
        self._check_fit()
        Trainer._fit_calls += 1
        index = Trainer._fit_calls
        env = detect(os.environ)
        handoff = os.environ.get(HANDOFF_ENV)
        started_by_fit = handoff is not None and env.launcher != "single"
        world = env.world_size if env.launcher != "single" else self.config.nprocs
        cfg = self._run_config(world)
        if started_by_fit:
            if index < int(os.environ.get(FIT_ENV, "1")):
                return self.model, self.optimizer  # the parent ran this fit already; its result arrives below
            state = portable.load_file(os.path.join(handoff, "initial.pt"))
            self.model.load_state_dict(state["model"])
            if self.optimizer is not None and state["optimizer"] is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            self._train(cfg, handoff)
            sys.stdout.flush()
            sys.exit(0)  # as with perceptrain's mp.spawn: only the calling process goes on after fit()
        if env.launcher == "single" and self.config.nprocs > 1:
            return self._spawn(cfg, index)
        self._train(cfg, None)
        return self.model, self.optimizer

    def _check_fit(self) -> None:
        if not self._use_grad:
            raise UnsupportedCombination("Trainer.set_use_grad(False) (gradient-free, nevergrad) is not supported by "
                                         "distkit.compat.perceptrain: use Trainer.set_use_grad(True) and a torch optimizer")
        for name, loader in (("train_dataloader", self.train_dataloader), ("val_dataloader", self.val_dataloader)):
            if loader is not None and not isinstance(loader, DataLoader):
                raise UsageError(f"fit(): {name} must be a torch DataLoader over a map-style dataset (or None for a "
                                 f"model without data), got {type(loader).__name__}")
        if self.config.val_every and self.val_dataloader is None:
            raise ConfigError(f"TrainConfig(val_every={self.config.val_every}) needs a validation DataLoader: pass "
                              "fit(train_loader, val_loader) or set val_every=0")
        if self.optimizer is None:
            raise UsageError("Trainer(model, None, ...): pass a torch optimizer")

    def _run_config(self, world: int) -> Any:
        """The validated distkit RunConfig for this fit (bad input: a DistkitError naming the fix)."""
        from distkit.backends import check_backend
        from distkit.session import config_from

        c = self.config
        dist = c.distributed_config()
        cuda = torch.cuda.is_available()
        if c.compute_setup == "gpu" and not cuda:
            raise BackendUnavailable("TrainConfig(compute_setup='gpu'): torch sees no CUDA device here; use "
                                     "compute_setup='cpu' (or 'auto', which takes a GPU when there is one)")
        on_cpu = c.compute_setup == "cpu" or not cuda
        if dist.get("pg_backend") == "nccl" and on_cpu:
            if world > 1:
                raise UnsupportedCombination(
                    f"TrainConfig(backend='nccl', compute_setup={c.compute_setup!r}): NCCL needs GPUs and this run is on "
                    "the CPU; use backend='gloo' (e.g. --backend gloo --compute_setup cpu)")
            dist["pg_backend"] = "gloo"  # one rank: nothing to communicate
        cfg, _ = config_from({"distributed": dist, "device": c.device(), "nprocs": c.nprocs,
                              "output_dir": str(c.root_folder), "progress_bar": False})
        check_backend(cfg)
        return cfg

    # -- plain python, nprocs > 1: start the ranks, take rank 0's result -------------------------------
    def _spawn(self, cfg: Any, index: int) -> tuple[nn.Module, Any]:
        from distkit.backends import strategy_class
        from distkit.launch.spawner import relaunch_command, run_local

        handoff = tempfile.mkdtemp(prefix="distkit-perceptrain-")
        try:
            torch.save({"model": self.model.state_dict(),
                        "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None},
                       os.path.join(handoff, "initial.pt"))
            saved = {k: os.environ.get(k) for k in (HANDOFF_ENV, FIT_ENV)}
            os.environ.update({HANDOFF_ENV: handoff, FIT_ENV: str(index)})
            try:
                sys.stdout.flush()
                code = run_local(relaunch_command(), self.config.nprocs,
                                 strategy_class(cfg.distributed.backend).local_launcher)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            result_path = os.path.join(handoff, "result.json")
            if code != 0 or not os.path.exists(result_path):
                err = RankFailure(f"fit(): the {self.config.nprocs} ranks it started did not finish (exit status {code}); "
                                  "their output above says why")
                err.exit_code = code if code > 0 else 1
                raise err
            with open(result_path) as f:
                result = json.load(f)
            # the ranks' final state (in sync: fit ends on a sync in param mode) into the caller's objects
            portable.load_into(result["checkpoint"], self.model, self.optimizer)
            self.summary = result["summary"]
            self.current_epoch, self.global_step = result["epoch"], result["summary"]["steps"]
        finally:
            shutil.rmtree(handoff, ignore_errors=True)
        return self.model, self.optimizer

    # -- the loop, on every rank --------------------------------------------------------------------------
    def _train(self, cfg: Any, handoff: Optional[str]) -> None:
        import distkit

        dk = distkit.init(cfg)
        run: Optional[_Fit] = None
        try:
            run = _Fit(self, dk, handoff)
            run.run()
        except BaseException:
            dk.abort()  # MPI engines: end the job so no rank waits for this one
            raise
        finally:
            # Free the engine's wrapper (DDP holds the process group) while the ranks are still together:
            # a DDP wrapper destroyed after destroy_process_group was seen to hang rank 0 in gloo's teardown.
            run = None
            dk._model = dk._optimizer = dk._scheduler = None  # Session internals: see docs/perceptrain.md
            gc.collect()
            dk.close()


class _Fit:
    def __init__(self, trainer: Trainer, dk: Any, handoff: Optional[str]) -> None:
        self.t, self.dk, self.c, self.handoff = trainer, dk, trainer.config, handoff
        self.root = Path(self.c.root_folder).absolute()
        dtype = self.c.dtype
        self.data_dtype = (torch.float64 if dtype is not None and dtype.is_complex else dtype)
        if dtype is not None:
            trainer.model.to(dtype=dtype)
        self.model, opt = dk.setup(trainer.model, trainer.optimizer)
        self.opt = DistkitOptimizer(dk, opt)
        # whole global batches only, as before re-sharding carried a loader's drop_last over (perceptrain's
        # figures in docs/perceptrain.md were measured so)
        self.train = (dk.dataloader(trainer.train_dataloader, drop_last=True) if trainer.train_dataloader is not None
                      else None)
        self.val = (dk.dataloader(trainer.val_dataloader, drop_last=True)
                    if trainer.val_dataloader is not None and self.c.val_every else None)
        self.steps = len(self.train) if self.train is not None else 1
        if trainer.max_batches is not None:
            self.steps = min(self.steps, trainer.max_batches)
        self.out = None
        if dk.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self.root / "config.json", "w") as f:
                json.dump({"perceptrain": {k: v for k, v in vars(self.c).items() if k != "hyperparams"},
                           "hyperparams": self.c.hyperparams, "distkit": cfg_json(dk),
                           "world_size": dk.world_size, "launcher": dk.env.launcher}, f, indent=2, default=repr)
            self.out = open(self.root / "metrics.jsonl", "w")

    def log(self, row: dict[str, Any]) -> None:
        if self.out is not None:
            self.out.write(json.dumps(row) + "\n")
            self.out.flush()

    def say(self, epoch: int, row: dict[str, Any], phase: str) -> None:
        """perceptrain's PrintMetrics line, rank 0, values averaged over ranks."""
        if not (self.dk.is_main and self.c.verbose):
            return
        key = f"{phase}_loss"
        msg = f"P {self.dk.rank: >2}|{self.dk.device.type: <7}| Iteration {epoch: >7}| {key.title()}: {row[key]:.7f} -"
        rest = " ".join(f"{k}: {v:.7f}" for k, v in row.items() if k.startswith(f"{phase}_") and k != key)
        print(msg + (" " + rest if rest else ""), flush=True)

    def reduce(self, phase: str, loss_sum: torch.Tensor, sums: dict[str, torch.Tensor], n: int) -> dict[str, float]:
        """Collective: the means over this epoch's batches, averaged over ranks (one all-reduce)."""
        names = sorted(sums)  # loss_fn's metric names: the same on every rank
        means = self.dk.all_reduce(torch.stack([loss_sum, *(sums[k] for k in names)]) / max(n, 1), op="mean")
        return {f"{phase}_loss": float(means[0]), **{f"{phase}_{k}": float(v) for k, v in zip(names, means[1:])}}

    def validate(self) -> dict[str, float]:
        """Collective: loss_fn over this rank's validation batches without gradients; means over ranks."""
        assert self.val is not None
        self.model.eval()
        loss_sum, sums, n = torch.zeros((), dtype=torch.float64), {}, 0
        with torch.no_grad():
            for batch in self.val:
                loss, metrics = self.t.loss_fn(_to(batch, None, self.data_dtype), self.model)
                loss_sum += _scalar(loss)
                for k, v in (metrics or {}).items():
                    sums[k] = sums.get(k, torch.zeros((), dtype=torch.float64)) + _scalar(v)
                n += 1
        self.model.train()
        return self.reduce("val", loss_sum, sums, n)

    def save(self, name: str, epoch: int) -> str:
        return self.dk.save(str(self.root / "checkpoints" / name),
                            {"model": self.model, "optimizer": self.dk.optimizer, "epoch": epoch})

    def run(self) -> None:
        dk, c, t = self.dk, self.c, self.t
        d = dk.cfg.distributed
        pg = f" ({getattr(dk._strategy, 'pg_backend', '')})" if dk.backend in ("ddp", "deepspeed") else ""
        dk.print(f"distkit: perceptrain Trainer on {dk.backend}{pg}/{d.reduce_type}, {dk.world_size} rank(s) via "
                 f"{dk.env.launcher}, device {dk.device}: {c.max_iter} epochs x {self.steps} steps; logs in {self.root}")
        val_row: dict[str, float] = {}
        if self.val is not None:  # as perceptrain: a validation of the untrained model first
            val_row = self.validate()
            self.log({"epoch": 0, "step": 0, **val_row})
            self.say(0, val_row, "val")
        first = last = float("nan")
        for epoch in range(1, c.max_iter + 1):
            t.current_epoch = epoch
            self.model.train()
            if self.train is not None:
                self.train.set_epoch(epoch - 1)
                batches: Any = self.train
            else:
                batches = [None] * self.steps
            loss_sum, sums, n = torch.zeros((), dtype=torch.float64), {}, 0
            for batch in batches:
                if n >= self.steps:
                    break
                loss, metrics = t.optimize_step(model=self.model, optimizer=self.opt, loss_fn=t.loss_fn, xs=batch,
                                                device=dk.device, dtype=self.data_dtype)
                loss_sum += _scalar(loss)
                for k, v in (metrics or {}).items():
                    sums[k] = sums.get(k, torch.zeros((), dtype=torch.float64)) + _scalar(v)
                n += 1
                t.global_step += 1
            row: dict[str, Any] = {"epoch": epoch, "step": dk.num_steps, **self.reduce("train", loss_sum, sums, n)}
            last = row["train_loss"]
            first = last if epoch == 1 else first
            if c.print_every and epoch % c.print_every == 0:
                self.say(epoch, row, "train")
            if self.val is not None and epoch % c.val_every == 0:
                val_row = self.validate()
                row.update(val_row)
                self.say(epoch, val_row, "val")
            validated = self.val is not None and epoch % c.val_every == 0  # validation rows are always written
            if (c.write_every and epoch % c.write_every == 0) or epoch == c.max_iter or validated:
                self.log(row)
            if c.checkpoint_every and epoch % c.checkpoint_every == 0 and epoch < c.max_iter:
                self.save(f"epoch-{epoch:05d}", epoch)
        dk.finish()  # param mode: the final average; every rank now holds the same model
        final = self.save("final", c.max_iter)
        summary = dk.summary(first_train_loss=first, final_train_loss=last, epochs=c.max_iter,
                             eval_loss=val_row.get("val_loss"), checkpoint=final)
        summary.pop("eval_accuracy", None)  # a perceptrain loss_fn reports its own metrics, nothing else
        t.summary = summary
        if dk.is_main:
            with open(self.root / "summary.json", "w") as f:
                json.dump(summary, f, indent=2)
            if self.out is not None:
                self.out.close()
            if self.handoff is not None:
                tmp = os.path.join(self.handoff, "result.json.part")
                with open(tmp, "w") as f:
                    json.dump({"checkpoint": final, "summary": summary, "epoch": c.max_iter}, f)
                os.replace(tmp, os.path.join(self.handoff, "result.json"))
        dk.print(f"distkit: done: {dk.num_steps} steps, train loss {first:.7f} (epoch 1) -> {last:.7f} "
                 f"(epoch {c.max_iter}), ranks in sync: {summary['ranks_in_sync']}; "
                 f"{self.root / 'metrics.jsonl'}, {self.root / 'summary.json'}, checkpoint {final}")


def cfg_json(dk: Any) -> dict[str, Any]:
    return dk.cfg.to_json().get("distributed", {})
