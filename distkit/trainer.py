"""The one training loop, for every backend and mode. No backend names in here.

Per rank: build the task with the same seed everywhere, let the Strategy wrap model and
optimizer, then loop over this rank's batches (:mod:`distkit.data`). Rank 0 writes
``config.resolved.json``, ``metrics.jsonl`` and ``summary.json`` under ``output_dir``.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import time
from typing import Any, Optional

import numpy as np
import torch
from tqdm import tqdm

from distkit import checkpoint, faults
from distkit.backends import strategy_class
from distkit.backends.base import Strategy
from distkit.config import RunConfig, resolve
from distkit.components import build_optimizer, pick_device
from distkit.data import BatchPlan, fetch, to_device
from distkit.env import ClusterEnv, detect
from distkit.evaluation import evaluate, param_checksum
from distkit.main_process import set_current_strategy
from distkit.tasks import Task, make_task

class Trainer:
    """Train ``config`` on this process's rank. Under a launcher, every rank calls ``fit()``.

    Example::

        import distkit
        summary = distkit.Trainer({"task": "digits", "torch_distributed": {}, "num_epochs": 3}).fit()
    """

    def __init__(self, config: RunConfig | dict[str, Any] | None = None, env: Optional[ClusterEnv] = None,
                 **keys: Any) -> None:
        self.cfg = config if isinstance(config, RunConfig) else resolve({**(config or {}), **keys})
        self.env = env or detect(os.environ)

    def fit(self) -> dict[str, Any]:
        """Train, evaluate, save; returns the summary (the content of summary.json) on every rank."""
        device = pick_device(self.cfg.device, self.env.local_rank)
        strategy = strategy_class(self.cfg.distributed.backend)(self.cfg, self.env, device)
        strategy.init()
        set_current_strategy(strategy)
        try:
            return _Run(self.cfg, strategy).run()
        except BaseException:
            strategy.abort()  # e.g. MPI_Abort: the other ranks must not wait for this one
            raise
        finally:
            set_current_strategy(None)
            strategy.teardown()


class _Run:
    def __init__(self, cfg: RunConfig, s: Strategy) -> None:
        self.cfg, self.s = cfg, s
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        self.task: Task = make_task(cfg)
        model = self.task.model_fn()
        self.model, self.opt = s.setup(model, build_optimizer(cfg, model.parameters(), s.world_size))
        self.bare = s.unwrap(self.model)
        n_train = len(self.task.train)  # type: ignore[arg-type]
        self.plan = BatchPlan(n_train, cfg.batch_size, s.rank, s.world_size, cfg.data_distribution, cfg.seed)
        # Ranks may hold different data (user datasets); the minimum step count never hangs.
        local = torch.tensor([self.plan.steps_per_epoch // cfg.accum_grad_multiple_step])
        self.steps_per_epoch = int(s.all_reduce(local, op="min").item())
        self.total_steps = self.steps_per_epoch * cfg.num_epochs
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self.step, self.samples, self.compute_s = 0, 0, 0.0
        self.ckpt_root = os.path.join(cfg.output_dir, "checkpoints")
        self.out = None
        if s.is_main:
            os.makedirs(cfg.output_dir, exist_ok=True)
            with open(os.path.join(cfg.output_dir, "config.resolved.json"), "w") as f:
                json.dump({**cfg.to_json(), "world_size": s.world_size, "launcher": s.env.launcher}, f, indent=2)
            d = cfg.distributed
            print(f"distkit: {d.backend}/{d.reduce_type} on {s.world_size} rank(s) via {s.env.launcher}, "
                  f"task {self.task.name}, batch {cfg.batch_size}/rank, {self.total_steps} steps; "
                  f"resolved config: {os.path.join(cfg.output_dir, 'config.resolved.json')}", flush=True)
        self._maybe_resume()
        if s.is_main:
            self.out = open(os.path.join(cfg.output_dir, "metrics.jsonl"), "a" if self.step else "w")

    def _state(self) -> dict[str, Any]:
        return {**self.s.state_dict(self.model, self.opt),
                "averager": self.s.averager.state_dict() if self.s.averager else None,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
                "progress": {"step": self.step, "samples": self.samples}}

    def _maybe_resume(self) -> None:
        path = checkpoint.latest(self.ckpt_root) if self.cfg.resume == "auto" else self.cfg.resume
        if not path:
            return
        st = checkpoint.load(path, self.s.rank, self.s.world_size)
        self.s.load_engine_files(path, self.model)
        self.s.load_state_dict(self.model, self.opt, st)
        if self.s.averager is not None and st["averager"] is not None:
            self.s.averager.load_state_dict(st["averager"])
        torch.set_rng_state(st["rng"]["torch"])
        random.setstate(st["rng"]["python"])
        np.random.set_state(st["rng"]["numpy"])
        self.step, self.samples = st["progress"]["step"], st["progress"]["samples"]
        if self.s.is_main:
            print(f"distkit: resumed from {path} at step {self.step}", flush=True)

    def _log(self, record: dict[str, Any]) -> None:
        if self.out is not None:
            self.out.write(json.dumps(record) + "\n")
            self.out.flush()

    def evaluate(self) -> tuple[Optional[float], Optional[float]]:
        """Collective: eval loss and accuracy (see :func:`distkit.evaluation.evaluate`)."""
        return evaluate(self.s, self.model, self.task, self.cfg.batch_size)

    def train_step(self, epoch: int, step_in_epoch: int) -> torch.Tensor:
        """One optimizer step of ``accum_grad_multiple_step`` micro-steps; returns the mean loss (detached)."""
        accum, s = self.cfg.accum_grad_multiple_step, self.s
        idxs = list(self.plan.indices(epoch, step_in_epoch * accum, (step_in_epoch + 1) * accum))
        total = torch.zeros(())
        for i, idx in enumerate(idxs):
            x, y = to_device(fetch(self.task.train, idx), s.device)
            # Only the last micro-step communicates; the others accumulate locally.
            with s.no_sync(self.model) if i < accum - 1 else contextlib.nullcontext():
                loss = self.task.loss(self.model(x), y) / accum
                s.backward(loss, self.model)
            total += loss.detach().cpu()
        if self.cfg.gradient_clip is not None:
            s.clip_grad_norm(self.model, self.opt, self.cfg.gradient_clip)
        s.step(self.model, self.opt)
        return total

    def run(self) -> dict[str, Any]:
        cfg, s = self.cfg, self.s
        per_step = cfg.batch_size * cfg.accum_grad_multiple_step * s.world_size
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not (s.is_main and cfg.progress_bar),
                   desc="train", unit="step", dynamic_ncols=True)
        t_start, window, window_n, train_loss = time.perf_counter(), torch.zeros(()), 0, float("nan")
        while self.step < self.total_steps:
            epoch, in_epoch = divmod(self.step, self.steps_per_epoch)
            t_epoch, c_epoch, n_epoch = time.perf_counter(), self.compute_s, 0
            for j in range(in_epoch, self.steps_per_epoch):
                if self.step >= self.total_steps:
                    break
                t0 = time.perf_counter()
                window += self.train_step(epoch, j)
                self.compute_s += time.perf_counter() - t0
                self.step, self.samples, window_n, n_epoch = self.step + 1, self.samples + per_step, window_n + 1, n_epoch + 1
                bar.update(1)
                faults.maybe_fire(s.rank, self.step)
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    train_loss = float(s.all_reduce(window / window_n, op="mean"))
                    elapsed = time.perf_counter() - t_start
                    self._log({"step": self.step, "epoch": epoch, "samples": self.samples, "loss": train_loss,
                               "lr": self.opt.param_groups[0]["lr"], "samples_per_s": self.samples / max(elapsed, 1e-9)})
                    bar.set_postfix(loss=f"{train_loss:.4f}")
                    window, window_n = torch.zeros(()), 0
                if cfg.eval_every and self.step % cfg.eval_every == 0:
                    el, ea = self.evaluate()
                    self._log({"step": self.step, "eval_loss": el, "eval_accuracy": ea})
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < self.total_steps:
                    checkpoint.save(s, self.ckpt_root, self.step, self._state(), self.model)
            wall = time.perf_counter() - t_epoch
            if s.is_main:
                bar.write(f"epoch {epoch + 1}: {n_epoch} steps, train loss {train_loss:.4f}, {wall:.2f}s, "
                          f"computing time {(self.compute_s - c_epoch) / max(wall, 1e-9):.1%}")
        bar.close()
        s.finish(self.model)
        wall = time.perf_counter() - t_start
        eval_loss, eval_acc = self.evaluate()
        checksum = param_checksum(s.full_named_parameters(self.model))
        in_sync = all(c == checksum for c in s.all_gather_object(checksum))
        checkpoint.save(s, self.ckpt_root, self.step, self._state(), self.model)
        summary = {
            "backend": cfg.distributed.backend, "backend_impl": s.backend_impl(),
            "reduce_type": cfg.distributed.reduce_type,
            "param_sync_step": cfg.distributed.param_sync_step if cfg.distributed.reduce_type == "param" else None,
            "world_size": s.world_size, "launcher": s.env.launcher, "zero_stage": getattr(s, "zero_stage", None),
            "steps": self.step, "samples": self.samples, "final_train_loss": train_loss,
            "eval_loss": eval_loss, "eval_accuracy": eval_acc, "param_checksum": checksum, "ranks_in_sync": in_sync,
            "wall_time_s": wall, "samples_per_s": self.samples / max(wall, 1e-9),
            "compute_fraction": self.compute_s / max(wall, 1e-9), "comm_bytes": s.comm_bytes,
        }
        if s.is_main:
            with open(os.path.join(cfg.output_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
            if self.out is not None:
                self.out.close()
        return summary

