"""The one training loop, for every backend and mode. No backend names in here.

Per rank: build the task with the same seed everywhere, let the Strategy wrap model and
optimizer, then loop over this rank's batches (:mod:`distkit.data`). Rank 0 writes
``config.resolved.json``, ``metrics.jsonl`` and ``summary.json`` under ``output_dir`` (the JSON
files atomically), holding the output_dir's lock unless the command that started it does.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any, Callable, Optional

import torch
from tqdm import tqdm

from distkit import checkpoint

from distkit.health import faults
from distkit.components import build_optimizer, build_scheduler, check_components
from distkit.config import RunConfig, resolve
from distkit.env import ClusterEnv
from distkit.errors import DistkitError, OutputError, Preempted, report_agreed
from distkit.health.preemption import Preemption
from distkit.evaluation import batch_loss, evaluate
from distkit.trackers.records import logged_records, ranks_by_host, sync_line, sync_record
from distkit.session import Session, init
from distkit.tasks import Task, check_task, make_task
from distkit.trackers import Trackers


class Trainer:
    """Train ``config`` on this process's rank. Under a launcher, every rank calls ``fit()``.

    Built on :func:`distkit.init`'s :class:`~distkit.session.Session` and nothing else, so
    ``distkit train`` and a user's own loop take the same path. Example::

        import distkit
        summary = distkit.Trainer({"task": "digits", "torch_distributed": {}, "num_epochs": 3}).fit()
    """

    def __init__(self, config: RunConfig | dict[str, Any] | None = None, env: Optional[ClusterEnv] = None,
                 **keys: Any) -> None:
        self.cfg = config if isinstance(config, RunConfig) else resolve({**(config or {}), **keys})
        check_task(self.cfg)
        check_components(self.cfg)
        self.env = env

    def fit(self) -> dict[str, Any]:
        """Train, evaluate, save; returns the summary (the content of summary.json) on every rank."""
        # the output_dir lock rank 0 takes (TrainingRun) is released at the end of this fit, unless whoever
        # called it (`distkit train`) holds it already, for its whole process
        held = checkpoint.holds_lock(self.cfg.output_dir)
        dk = init(self.cfg, env=self.env)
        run: Optional[TrainingRun] = None
        try:
            run = TrainingRun(self.cfg, dk)
            return run.run()
        except BaseException as e:
            if run is not None:
                with contextlib.suppress(Exception):  # the run's own error is the one to report
                    run.trackers.finish(None, "failed")  # a no-op after a preemption's or a finished run's own
            if isinstance(e, DistkitError) and e.agreed:  # every rank raised it together: nobody waits
                report_agreed(e, dk.rank)  # before the ranks meet in dk.close (see report_agreed)
            else:
                dk.abort()  # e.g. MPI_Abort: the other ranks must not wait for this one
            raise
        finally:
            if run is not None and run._preemption is not None:
                run._preemption.remove()
            dk.close()
            if not held:
                checkpoint.unlock_output_dir(self.cfg.output_dir)


class TrainingRun:
    """One rank's training run: the object ``callbacks`` receive as ``trainer``.

    Read-only for callbacks: ``cfg``, ``dk`` (the Session), ``model``, ``optimizer``, ``lr_scheduler``,
    ``step`` (optimizer steps done), ``total_steps``, ``rank``, ``world_size``, ``is_main``; and
    :meth:`request_stop`. Callback methods (all optional) are called on every rank, in list order:
    ``on_train_start(trainer)``, ``on_step_end(trainer, metrics)`` at every log point (the logged record),
    ``on_eval_end(trainer, metrics)``, ``on_checkpoint(trainer, path)``, ``on_train_end(trainer, summary)``.
    """

    def __init__(self, cfg: RunConfig, dk: Session) -> None:
        self.cfg, self.dk = cfg, dk
        self.task: Task = make_task(cfg)
        model = self.task.model_fn()
        self.loader = dk.dataloader(self.task.train, batch_size=cfg.batch_size, collate_fn=self.task.collate_fn,
                                    num_workers=cfg.num_workers)
        self.best: dict[str, Any] = {}  # the best eval so far (lowest eval_loss) and its step
        self.steps_per_epoch = len(self.loader) // cfg.accum_grad_multiple_step
        # max_steps, when set, is the run length (epochs repeat the data), as in HF's Trainer
        self.total_steps = cfg.max_steps if cfg.max_steps is not None else self.steps_per_epoch * cfg.num_epochs
        self.callbacks, self._stop = list(cfg.callbacks), False
        self._pending: Optional[checkpoint.PendingCheckpoint] = None  # checkpoint_async: the one being written
        self._ft_logged, self._ft_groups, self._ft_heals = 0, None, 0  # fault_tolerance: syncs reported, heals seen
        self._data_offset = 0  # data steps ahead of the step count: nonzero after a resume with another global batch
        scheduler = build_scheduler(cfg, self.total_steps)
        # The factory is called with this bare model's parameters (names without a wrapper's "module."
        # prefix, as the user wrote the model); a factory that asks for named_parameters gets them by name.
        cfg.writes_outputs = True  # (the engines' own files, e.g. DeepSpeed's resolved config, go there too)
        made = dk.setup(model, lambda params: build_optimizer(cfg, params, dk.world_size, model.named_parameters),
                        scheduler)
        self.model, self.opt = made[0], made[1]
        self.lr_scheduler = dk.lr_scheduler  # also the DeepSpeed config's own scheduler block
        self.ckpt_root = os.path.join(cfg.output_dir, "checkpoints")
        self.out = None
        #: a scheduler's SIGTERM/SIGUSR1 stops after an agreed step with a checkpoint (installed by run)
        self._preemption = Preemption() if cfg.preemption else None
        self._maybe_resume()  # before anything is written: a checkpoint that does not fit leaves output_dir untouched
        resolved = {**cfg.to_json(), "run_id": dk.run_id, "world_size": dk.world_size, **dk.topology(), "launcher": dk.env.launcher}
        self._write_json("config.resolved.json", resolved)
        if dk.is_main:
            d = cfg.distributed
            print(f"distkit: {d.backend}/{d.reduce_type} on {dk.world_size} rank(s) via {dk.env.launcher}, "
                  f"task {self.task.name}, batch {cfg.batch_size}/rank, {self.total_steps} steps; "
                  f"resolved config: {os.path.join(cfg.output_dir, 'config.resolved.json')}", flush=True)
            if resolved["num_nodes"] > 1:  # where each rank runs, from the host names the ranks reported
                print(f"distkit: ranks by host: {ranks_by_host(resolved['hosts'], resolved['node_ranks'])}", flush=True)
        #: a resumed run's records up to this step were logged by the earlier run (those after its last checkpoint
        #: too): they are not logged again, in metrics.jsonl or a tracker (no duplicate points on a step axis)
        self._logged_through = 0
        self.trackers = Trackers([])
        earlier: list[dict[str, Any]] = []  # a resumed run's metrics.jsonl, on rank 0
        if dk.is_main:
            metrics = os.path.join(cfg.output_dir, "metrics.jsonl")
            earlier = logged_records(metrics) if dk.num_steps else []
            self._logged_through = max((r["step"] for r in earlier), default=0)
            if self._logged_through > dk.num_steps:  # said, so that a resume from an older checkpoint hides nothing unseen
                print(f"distkit: metrics.jsonl holds steps up to {self._logged_through} from the earlier run; steps "
                      f"{dk.num_steps + 1}-{self._logged_through} are not logged again (there or in a tracker)", flush=True)
            self.out = checkpoint.open_own(metrics, "a" if dk.num_steps else "w")
        if cfg.loggers:
            # rank 0 starts them; one that cannot start (a store it cannot write, a W&B error) stops every rank
            def start() -> None:
                self.trackers = Trackers.open(cfg.loggers, cfg.output_dir, dk.run_id, resolved, resumed=dk.num_steps > 0)
                if dk.num_steps:  # what a tracker lost when the earlier run was killed comes from metrics.jsonl
                    for line in self.trackers.catch_up(earlier):
                        print(line, flush=True)
            self._on_main(start, Exception, wrap=True)

    # -- what callbacks see ---------------------------------------------------------------------
    @property
    def optimizer(self) -> Any:
        return self.opt

    @property
    def step(self) -> int:
        """Optimizer steps done so far (the same on every rank)."""
        return self.dk.num_steps

    @property
    def rank(self) -> int:
        return self.dk.rank

    @property
    def world_size(self) -> int:
        return self.dk.world_size

    @property
    def is_main(self) -> bool:
        """True on rank 0: guard a callback's file and console output with it."""
        return self.dk.is_main

    def request_stop(self) -> None:
        """Stop training early, from any rank (a callback). Every rank stops after the same step: the ranks'
        requests are combined (a MAX all-reduce) after the hooks of each log point (``log_every``) and eval
        point (``eval_every``), so a request from ``on_step_end`` or ``on_eval_end`` stops after that step.
        The run then ends normally (final eval, checkpoint, summary with ``stopped_early``)."""
        self._stop = True

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(self, *args)

    def _state(self) -> dict[str, Any]:
        state = {"model": self.model, "optimizer": self.opt}
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler
        return state

    def _maybe_resume(self) -> None:
        """Rank 0 picks the checkpoint (``resume``: "auto" = the newest verified complete one, falling back from a
        damaged ``latest`` and saying so; a directory; None/"none" = start fresh), checks that it fits this world size
        and model, and keeps the output_dir's run id when it continues; every rank loads it or raises the same error."""
        faults.maybe_fire(self.dk.rank, 0, "setup")  # (a rank whose set-up work takes long: tests of start-up's bound)
        choice: tuple[Optional[str], list[str], Optional[BaseException], str] = (None, [], None, "")
        if self.dk.is_main:
            try:
                checkpoint.refuse_if_in_use(self.cfg.output_dir)  # a live run's checkpoints: "in use", not "earlier"
                path, notes = checkpoint.fitting_checkpoint(self.cfg, self.dk.world_size,
                                                            lambda: checkpoint.model_shapes(self.dk.unwrap()))
                run_id = (checkpoint.recorded_run_id(self.cfg.output_dir) if path else None) or checkpoint.new_run_id()
                if path is not None:
                    foreign = checkpoint.run_id_note(path, run_id)
                    notes = [*notes, foreign] if foreign else notes
                # the run's lock on output_dir, held by rank 0 to its end (a no-op where `distkit train` or
                # the command that started the ranks holds it): another run there stops every rank with one line
                checkpoint.lock_output_dir(self.cfg.output_dir)
                choice = (path, notes, None, run_id)
            except DistkitError as e:
                choice = (None, [], e, "")
        path, notes, error, self.dk.run_id = self.dk.broadcast_object(choice, 0) if self.dk.world_size > 1 else choice
        if error is not None:
            if isinstance(error, DistkitError):
                error.agreed = True  # every rank raises rank 0's finding: reported once
            raise error
        for note in notes:
            self.dk.print(f"distkit: {note}")
        if not path:
            return
        self.dk.load(path, self._state())
        self.dk.print(f"distkit: resumed from {path} at step {self.dk.num_steps}")
        old = self.dk.resumed_global_batch
        new = self.cfg.batch_size * self.dk.world_size * self.cfg.accum_grad_multiple_step
        if old and old != new:
            self._data_offset = self._data_step(old, new) - self.dk.num_steps
            self.dk.print(f"distkit: the global batch changes from {old} to {new} samples per step; the data continues "
                          f"at global sample {self.dk.num_samples} (epoch {self._epoch_and_step()[0] + 1}), the "
                          f"step count at {self.dk.num_steps}")

    def _data_step(self, old: int, new: int) -> int:
        """The data position (in steps of the ``new`` global batch since the start) of the sample a run with
        global batch ``old`` stopped at: same epoch, same place in the epoch's order (rounded down to a
        whole batch). Exact in ``shard`` mode, whose order per epoch does not depend on the batch size."""
        n = len(self.task.train)  # type: ignore[arg-type]
        epoch, pos = divmod(self.dk.num_samples, max(n // old, 1) * old)
        return epoch * self.steps_per_epoch + min(pos // new, self.steps_per_epoch)

    def _epoch_and_step(self) -> tuple[int, int]:
        """(epoch, step within it) of the data at the current step (see :meth:`_data_step`)."""
        return divmod(self.dk.num_steps + self._data_offset, self.steps_per_epoch)

    def _save(self, final: bool = False) -> None:
        """Collective: a checkpoint of the current step. With ``checkpoint_async`` (not for the ``final``
        one) its files are written in the background and it is completed (``latest`` moved to it) at the
        next checkpoint. The time the loop stops is in the summary (``checkpoint_stalls_s``)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._completed(pending.commit())
        path = os.path.join(self.ckpt_root, checkpoint.step_name(self.dk.num_steps))
        if self.cfg.checkpoint_async and not final:
            self._pending = self.dk.save_async(path, self._state())
        else:
            self._completed(self.dk.save(path, self._state()))

    def _completed(self, path: str) -> None:
        """Collective: point ``latest`` at the complete checkpoint ``path`` (rank 0; every rank raises its
        error) and call the ``on_checkpoint`` hooks."""
        name = os.path.basename(path)
        # e.g. a full disk: every rank stops with it, none waits for rank 0
        self._on_main(lambda: checkpoint.mark_latest(self.ckpt_root, name, keep=self.cfg.keep_checkpoints), DistkitError)
        self._call("on_checkpoint", path)

    def _on_main(self, write: Callable[[], Any], errors: type[BaseException], wrap: bool = False) -> None:
        """Collective: rank 0 runs ``write``; an ``errors`` exception it raises is raised on every rank, marked
        agreed (reported once), so the job stops with one line and no rank waits for rank 0. ``wrap``: a
        library's own exception (which may not pickle) travels as an :class:`OutputError` naming it."""
        error: Optional[BaseException] = None
        if self.dk.is_main:
            try:
                write()
            except errors as e:
                error = e if not wrap or isinstance(e, DistkitError) else OutputError(
                    f"a tracker of 'loggers' could not start: {type(e).__name__}: {e}")
        if self.dk.world_size > 1:
            error = self.dk.broadcast_object(error, 0)
        if error is not None:
            error.agreed = True  # type: ignore[attr-defined]  # every rank raises it here: reported once
            raise error

    def _sync_counts(self) -> Optional[dict[str, int]]:
        """Param mode: this rank's sync events and bytes handed to the syncs' collectives since the run started
        (:meth:`distkit.sync.averager.ParamAverager.metrics`: a resume continues them); None in grad mode."""
        averager = getattr(self.dk._strategy, "averager", None)
        return averager.metrics() if averager is not None else None

    def _log(self, record: dict[str, Any]) -> None:
        """Rank 0: one record to metrics.jsonl and the trackers (not one of a step the earlier run logged)."""
        if self.out is None or record.get("step", self._logged_through + 1) <= self._logged_through:
            return
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()
        self.trackers.log(record)

    def evaluate(self) -> dict[str, float]:
        """Collective: ``eval_loss`` and the task's ``eval_<metric>``s (see :func:`distkit.evaluation.evaluate`);
        remembers the best (lowest eval_loss)."""
        result = evaluate(self.dk, self.model, self.task, self.cfg.batch_size)
        if result and ("best_eval_loss" not in self.best or result["eval_loss"] < self.best["best_eval_loss"]):
            self.best = {"best_eval_loss": result["eval_loss"], "best_eval_step": self.dk.num_steps}
        if result:
            self._call("on_eval_end", result)
        return result

    def train_step(self, batches: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One optimizer step of ``accum_grad_multiple_step`` micro-steps; returns the mean loss and the
        mean of the metrics a ``train_step`` returned (detached, on the CPU)."""
        accum, dk = self.cfg.accum_grad_multiple_step, self.dk
        total, metrics = torch.zeros(()), {}
        for i in range(accum):
            batch = next(batches)
            # Only the last micro-step communicates; the others accumulate locally.
            with dk.no_sync() if i < accum - 1 else contextlib.nullcontext():
                with dk.autocast():
                    loss, step_metrics = batch_loss(self.task, self.model, batch, train=True)
                if isinstance(loss, torch.Tensor):
                    loss = loss / accum
                dk.backward(loss)  # a non-scalar or non-tensor loss: UsageError naming the fix
            total += loss.detach().cpu()
            for name, value in step_metrics.items():
                metrics[name] = metrics.get(name, 0.0) + torch.as_tensor(value, dtype=torch.float64).detach().cpu() / accum
        dk.step()
        return total, metrics

    def run(self) -> dict[str, Any]:
        cfg, dk = self.cfg, self.dk
        bar = tqdm(total=self.total_steps, initial=dk.num_steps, disable=not (dk.is_main and cfg.progress_bar),
                   desc="train", unit="step", dynamic_ncols=True)
        dk._start_clock()  # the resume and the trackers' start (W&B's: seconds) were start-up, not training
        t_start, window, window_n, train_loss = time.perf_counter(), torch.zeros(()), 0, float("nan")
        window_metrics: dict[str, torch.Tensor] = {}
        sync_mark = self._sync_counts()  # param mode: the syncs and bytes at the last record (resumed: the saved)
        self._call("on_train_start")
        stopped = False
        if self._preemption is not None:
            self._preemption.install()
        while dk.num_steps < self.total_steps and not stopped:
            epoch, in_epoch = self._epoch_and_step()
            t_epoch, c_epoch, n_epoch, epoch_sum = time.perf_counter(), dk.compute_time_s, 0, torch.zeros(())
            self.loader.set_epoch(epoch, start=in_epoch * cfg.accum_grad_multiple_step)
            batches = iter(self.loader)
            for _ in range(in_epoch, self.steps_per_epoch):
                if dk.num_steps >= self.total_steps:
                    break
                loss, step_metrics = self.train_step(batches)
                window, epoch_sum = window + loss, epoch_sum + loss
                for name, value in step_metrics.items():
                    window_metrics[name] = window_metrics.get(name, 0.0) + value
                window_n, n_epoch = window_n + 1, n_epoch + 1
                step = dk.num_steps
                bar.update(1)
                faults.maybe_fire(dk.rank, step)
                ft = dk.fault_tolerance
                if ft is not None and len(ft.syncs) > self._ft_logged:
                    # each sync across fault-tolerant groups whose membership or outcome changed: one record
                    for sync in ft.syncs[self._ft_logged:]:
                        if sync["healed"] or not sync["committed"] or (sync["groups"], sync["members"]) != self._ft_groups:
                            self._log({"event": "sync", **sync})
                            dk.print(sync_line(sync, ft.replica_id, self._ft_groups[1] if self._ft_groups else None))
                        self._ft_groups = sync["groups"], sync["members"]
                    self._ft_logged = len(ft.syncs)
                    if ft.heals > self._ft_heals:  # this group healed: the step count jumped, the data follows it
                        self._ft_heals = ft.heals
                        bar.n = dk.num_steps
                        break
                if step % cfg.log_every == 0 or step == self.total_steps:
                    names = sorted(window_metrics)  # a train_step's metrics: the same names on every rank
                    means = dk.all_reduce(torch.stack([window.double(), *(window_metrics[n] for n in names)]) / window_n,
                                          op="mean")
                    train_loss = float(means[0])
                    elapsed = time.perf_counter() - t_start
                    # loss_steps: how many steps the loss averages (log_every; fewer in the first record after a
                    # resume between log points, and at the last step)
                    record = {"step": step, "epoch": epoch, "samples": dk.num_samples, "loss": train_loss,
                              "loss_steps": window_n,
                              **{n: float(v) for n, v in zip(names, means[1:])},
                              "lr": self.opt.param_groups[0]["lr"], "samples_per_s": dk.num_samples / max(elapsed, 1e-9),
                              # rank 0's seconds since training started, and of those blocked on the training
                              # collectives (gradient all-reduce, averaging): for `distkit plot`
                              "time_s": round(elapsed, 3), "comm_wait_s": round(dk.comm_wait_s, 3)}
                    counts = self._sync_counts()
                    if counts is not None and sync_mark is not None:
                        record.update(sync_record(counts, sync_mark))
                        sync_mark = counts
                    self._log(record)
                    bar.set_postfix(loss=f"{train_loss:.4f}", samples_s=f"{record['samples_per_s']:.0f}",
                                    comm=f"{record['comm_wait_s']:.1f}s")
                    window, window_n, window_metrics = torch.zeros(()), 0, {}
                    self._call("on_step_end", record)
                if cfg.eval_every and step % cfg.eval_every == 0:
                    self._log({"step": step, **self.evaluate(), "time_s": round(time.perf_counter() - t_start, 3)})
                if self.callbacks and (step % cfg.log_every == 0 or (cfg.eval_every and step % cfg.eval_every == 0)):
                    # a callback may have asked to stop (on any rank): agree on it now, after the hooks of this step
                    stopped = bool(dk.all_reduce(torch.tensor([float(self._stop)]), op="max").item() > 0)
                    if stopped:
                        dk.print(f"distkit: stop requested by a callback; stopping after step {step}")
                if self._preemption is not None and step < self.total_steps:
                    received = self._preemption.agreed(dk)
                    if received:
                        self._preempted(received, step)
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < self.total_steps and not stopped:
                    self._save()
                if stopped:
                    break
            wall = time.perf_counter() - t_epoch
            # this epoch's own mean loss over ranks (one all-reduce per epoch; every rank ran n_epoch steps)
            epoch_loss = float(dk.all_reduce(epoch_sum / max(n_epoch, 1), op="mean"))
            if dk.is_main:
                bar.write(f"epoch {epoch + 1}: {n_epoch} steps, train loss {epoch_loss:.4f}, {wall:.2f}s, "
                          f"computing time {(dk.compute_time_s - c_epoch) / max(wall, 1e-9):.1%}")
        bar.close()
        if self._preemption is not None:
            self._preemption.settle(dk)  # the checks of the last steps, still in flight
        dk.finish()
        evaluated = self.evaluate()
        self._save(final=True)
        summary = dk.summary(final_train_loss=train_loss, **evaluated, **self.best)
        if "eval_accuracy" not in evaluated and "accuracy" not in self.task.metrics:
            # e.g. a regression: an accuracy would mean nothing. One the evaluation produced (the task's metric,
            # or an eval_step's {"accuracy": ...}) stays, even where the task itself asks for none.
            summary.pop("eval_accuracy", None)
        summary["stopped_early"] = stopped
        ft = summary.get("fault_tolerance")
        if ft and ft["last_syncs_alone"]:
            first = [x["step"] for x in dk.fault_tolerance.syncs][-ft["last_syncs_alone"]]
            dk.print(f"distkit: group {ft['replica_id']} made its last {ft['last_syncs_alone']} sync(s) alone (from step "
                     f"{first} on; {ft['alone_syncs']} of {ft['syncs']} in all): no other of the {ft['num_replicas']} "
                     "groups took part (they ended, failed or never started), so its model is not theirs")
        self._call("on_train_end", summary)
        if self.out is not None:
            self.out.close()
        self._write_json("summary.json", summary)
        self.trackers.finish(summary, "finished")
        return summary

    def _preempted(self, received: str, step: int) -> None:
        """Collective: a rank received ``received`` (SIGTERM, SIGUSR1): save step ``step`` and stop every rank
        with :class:`Preempted` (agreed: reported once, exit status 75)."""
        assert self._preemption is not None
        self._preemption.settle(self.dk)
        self._save(final=True)  # synchronous (a pending async one is completed first)
        if self.out is not None:
            self.out.close()
            self.out = None
        self.trackers.finish(None, "preempted")
        error = Preempted(f"stopped by {received} after step {step} of {self.total_steps}; checkpoint "
                          f"{checkpoint.step_name(step)} written: continue with ++resume auto")
        error.agreed = True
        raise error

    def _write_json(self, name: str, obj: Any) -> None:
        """Collective: rank 0 writes ``obj`` to ``output_dir/name`` atomically (a full disk leaves the previous
        file intact, see :func:`distkit.checkpoint.write_json`); its error is raised on every rank, so the job
        stops with one line and no rank waits for rank 0."""
        self._on_main(lambda: checkpoint.write_json(os.path.join(self.cfg.output_dir, name), obj), OutputError)
