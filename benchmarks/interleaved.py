"""distkit against its engine's hand-written loop in the same processes: blocks of steps, alternating (issue 37).

    python benchmarks/interleaved.py --backend ddp|mpi|horovod|deepspeed|fsdp [--path cli|byo] [--pairs 60]
                                     [--block 10] [--aa] [--knob preemption] [--size small|medium] [--pin]
                                     [--threads-cpu] [--out PATH]

One job of ``--nprocs`` ranks under the engine's launcher (as ``overhead.py``: torchrun for ddp, deepspeed and fsdp,
mpirun for mpi and horovod). Each rank holds two copies of the ``charlm`` workload: side A, the hand-written loop
of the engine (``raw_<engine>.py``'s ``build``: raw DDP, raw mpi4py, raw Horovod, raw DeepSpeed, raw FSDP2 on the
engine distkit started), and side B, distkit (``--path byo``: the own-loop API, ``dk.setup`` / ``dk.dataloader`` /
``dk.backward`` / ``dk.step``; ``--path cli``: ``distkit train`` itself, run in-process, whose
``TrainingRun.train_step`` is wrapped so that the hand-written blocks run between its steps). The two sides
alternate in blocks of ``--block`` steps, pair by pair, in ABBA order (A B, B A, A B, ...). A pair's ratio is
B's block time over A's: wall time (``perf_counter``, from the start of a block's first step to the start of
whatever follows its last, so distkit's per-step loop work is in it) and rank 0's CPU time (``process_time``).
The first ``--warmup-pairs`` pairs are left out; the result is the median of the per-pair ratios with its 95 %
bootstrap interval.

Why in-process: separate processes per side (``overhead.py``) differ by more than the overhead to be measured
(one ~9 s process pair: 0.81 to 1.16 for identical work, A/A), so their interval narrows only as 1/sqrt(pairs)
from ±10 %. Here both sides share the processes, their memory layout, the launcher, the core each rank is on and
the machine's state within a second, and a pair costs ~1 s: hundreds of pairs fit into a few minutes.
What it cannot see by the ratio: per-process costs (start-up: ``startup.py``) and work distkit does in background
threads (the watchdog's heartbeat and judge), which run beside both sides alike; for those it reports rank 0's
CPU seconds of every ``distkit-*`` thread over the job (``background_cpu_s``, from ``/proc``): what they can take
from the training at most, as a share of the job's wall time.

``--aa``: side B is a second copy of the hand-written loop (horovod: under other tensor names): the ratio must be
1 within its interval, which shows what the method resolves. ``--knob preemption`` (``--path cli``): side A is
distkit itself with the feature off and B with it on, in the same job, by switching
``TrainingRun``'s preemption check per block (the check is one MAX all-reduce per step; both ranks switch at
the same step).

Same work: both sides do the same optimizer steps on the same data; at the end the two models' parameters must
be equal (``param_checksum``), else the script fails. Writes ``interleaved_<backend>_<path>[_aa|_knob].json``
into a fresh temp directory (or ``--out``) and prints a summary line. Each job has ``--run-timeout`` seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import overhead  # noqa: E402  (the launchers, the engines' distributed sections, the statistics, the runner)
from workload import launcher_rank, pin_rank  # noqa: E402

#: per-rank worker: the schedule and the workload travel in one JSON file
WORKER = "--worker"


# --------------------------------------------------------------------------- the schedule, run on every rank
class Alternator:
    """Runs the blocks of the schedule as side B's steps come: ``tick()`` is called at the start of every step
    of side B; whenever B's current block has ``block`` steps, it is closed, the A blocks that follow it are run
    here (timed), and B's next block is opened. B runs :attr:`b_total` steps: its last one, whose start closes
    the last block, is matched by one more (untimed) step of A, so both end having done the same steps (and
    A's, under ``distkit train``, before distkit ends the engine). Every rank runs the same schedule, so the
    engines' collectives match. Rank 0's block times: :attr:`blocks`."""

    def __init__(self, pairs: int, block: int, run_a: Callable[[int], Any],
                 run_a_block: Optional[Callable[[int], Any]] = None) -> None:
        # run_a_block(n), where given, takes A's next n steps at once (a framework's whole loop run in a thread of
        # its own, threaded_side.py: one hand-over per block rather than per step); run_a(i) then takes A's step i
        self.block, self.run_a = block, run_a
        self.run_a_block = run_a_block or self._steps_of_a
        # ABBA: pair p is (A, B) for even p, (B, A) for odd p
        self.sides = [s for p in range(pairs) for s in (("A", "B") if p % 2 == 0 else ("B", "A"))]
        self.pair_of = [i // 2 for i in range(len(self.sides))]
        self.next = 0                      # the next block of the schedule to open
        self.b_steps = 0                   # steps of the open B block so far
        self.b_open: Optional[tuple[float, float]] = None
        self.a_step = 0                    # side A's next step index (its own data order)
        self.done = False                  # the schedule is over (A's extra step taken)
        self.blocks: list[dict[str, Any]] = []
        self._threads: dict[str, float] = threads_cpu() if THREADS_CPU else {}

    @property
    def b_total(self) -> int:
        """How many steps side B must run: every B block, plus one step whose start closes the last block."""
        return self.sides.count("B") * self.block + 1

    def _record(self, side: str, t0: tuple[float, float], t1: tuple[float, float]) -> None:
        self.blocks.append({"side": side, "pair": self.pair_of[len(self.blocks)], "wall_s": t1[0] - t0[0],
                            "cpu_s": t1[1] - t0[1]})
        if THREADS_CPU:  # --threads-cpu: what every thread of the process used since the last block ended
            now = threads_cpu()
            self.blocks[-1]["threads_cpu_s"] = {k: round(v - self._threads.get(k, 0.0), 3) for k, v in now.items()
                                                if v - self._threads.get(k, 0.0) > 0}
            self._threads = now

    def _steps_of_a(self, n: int) -> None:
        for k in range(n):
            self.run_a(self.a_step + k)

    def tick(self) -> None:
        now = (time.perf_counter(), time.process_time())
        if self.b_open is not None and self.b_steps < self.block:
            self.b_steps += 1
            return
        if self.b_open is not None:  # B's block is complete: this is the start of what follows its last step
            self._record("B", self.b_open, now)
            self.b_open = None
        while self.next < len(self.sides) and self.sides[self.next] == "A":
            t0 = (time.perf_counter(), time.process_time())
            self.run_a_block(self.block)
            self.a_step += self.block
            self._record("A", t0, (time.perf_counter(), time.process_time()))
            self.next += 1
        if self.next < len(self.sides):  # B's next block starts with this step
            self.next += 1
            self.b_open, self.b_steps = (time.perf_counter(), time.process_time()), 1
        elif not self.done:  # the schedule is over: this is B's extra step; A takes one too (same work)
            self.run_a(self.a_step)
            self.a_step += 1
            self.done = True


class Toggler:
    """``--knob preemption``: both sides are ``distkit train``'s own steps, side A with the preemption check off
    (``TrainingRun._preemption`` set to None for A's blocks: the loop then skips it), side B as shipped; the same
    ABBA schedule of blocks, switched at the start of each block's first step (the same step on every rank, so
    the check's all-reduces still match). Checks still in flight when A's block starts are taken by B's next
    ones, as after any step."""

    def __init__(self, pairs: int, block: int, run: Any) -> None:
        self.sides = [s for p in range(pairs) for s in (("A", "B") if p % 2 == 0 else ("B", "A"))]
        self.block, self.run, self.feature = block, run, run._preemption
        assert self.feature is not None, "--knob preemption needs preemption = True"
        self.steps, self.a_step, self.done = 0, 0, False
        self.open: Optional[tuple[float, float]] = None
        self.blocks: list[dict[str, Any]] = []

    @property
    def b_total(self) -> int:
        return len(self.sides) * self.block + 1

    def tick(self) -> None:
        now = (time.perf_counter(), time.process_time())
        i, k = divmod(self.steps, self.block)
        self.steps += 1
        if k:
            return
        if self.open is not None:
            self.blocks.append({"side": self.sides[i - 1], "pair": (i - 1) // 2, "wall_s": now[0] - self.open[0],
                                "cpu_s": now[1] - self.open[1]})
        if i < len(self.sides):
            self.run._preemption = None if self.sides[i] == "A" else self.feature
            self.a_step += self.block if self.sides[i] == "A" else 0
            self.open = (time.perf_counter(), time.process_time())
        else:
            self.run._preemption, self.open, self.done = self.feature, None, True


#: ``--threads-cpu`` (set in the worker from the job's spec): record every thread's CPU per block
THREADS_CPU = False


def _thread_cpu_s(tid: int) -> Optional[float]:
    """CPU seconds (user + system, 10 ms ticks) thread ``tid`` of this process has used, or None once it is gone."""
    # /proc/self/task/TID/stat: the thread's own counters (/proc/TID/stat, what distkit.launch.procfs reads, holds the
    # whole process's)
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def threads_cpu() -> dict[str, float]:
    """CPU seconds of every thread of this process so far, by ``name#tid`` (the main thread: ``main``): Horovod's
    background thread, MPI's and gloo's, torch's pool, distkit's."""
    out: dict[str, float] = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        cpu = _thread_cpu_s(tid)
        if cpu is None:
            continue
        if tid == os.getpid():
            out["main"] = cpu
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()  # (threads inherit the process's name)
        except OSError:
            continue
        out[f"{name}#{tid}"] = cpu
    return out


def background_cpu() -> dict[str, float]:
    """CPU seconds each of distkit's background threads (``distkit-*``: the watchdog's heartbeat and judge, ...)
    has used so far in this process: an upper bound of what they take from the training, which an in-process A/B
    cannot see (they run beside both sides)."""
    import threading

    out: dict[str, float] = {}
    for t in threading.enumerate():
        cpu = _thread_cpu_s(t.native_id) if t.name.startswith("distkit-") and t.native_id is not None else None
        if cpu is not None:
            out[t.name] = out.get(t.name, 0.0) + cpu
    return out


def build_raw(backend: str, args: argparse.Namespace, names: str = "") -> Any:
    """The engine's hand-written loop (``raw_<backend>.build``) on the engine distkit started, built without
    touching the process's random state (distkit's run goes on with its own)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        if backend in ("ddp", "deepspeed", "fsdp"):
            import torch.distributed as dist

            mod = __import__(f"raw_{backend}")
            return mod.build(args, dist.get_rank(), dist.get_world_size())
        if backend == "mpi":
            from mpi4py import MPI

            import raw_mpi

            return raw_mpi.build(args, MPI.COMM_WORLD)
        import raw_horovod

        return raw_horovod.build(args, names=names)


def worker(spec_path: str, argv: list[str]) -> int:
    """One rank: side B's loop (or ``distkit train``) driving an :class:`Alternator` over side A."""
    pin_rank()  # before torch starts its threads
    with open(spec_path) as f:
        spec = json.load(f)
    args = argparse.Namespace(**spec["workload"])
    backend, path, mode = spec["backend"], spec["path"], spec["mode"]
    global THREADS_CPU
    THREADS_CPU = bool(spec.get("threads_cpu"))
    import torch

    result: dict[str, Any] = {}
    if path == "cli":
        from distkit import trainer

        from distkit.commands import cli
        holder: dict[str, Any] = {}
        inner = trainer.TrainingRun.train_step

        def timed(self: Any, *a: Any, **kw: Any) -> Any:
            if "alt" not in holder:  # the first step: the engine is up, build side A on it
                if mode == "knob":
                    holder["alt"] = Toggler(spec["pairs"], spec["block"], self)
                else:
                    holder["raw"] = build_raw(backend, args)
                    holder["alt"] = Alternator(spec["pairs"], spec["block"], holder["raw"].step)
            holder["alt"].tick()
            if holder["alt"].done and "threads" not in holder:  # the schedule is over; distkit's threads still run
                holder["threads"] = background_cpu()
                if mode != "knob":
                    holder["checksum"] = holder["raw"].checksum()  # (collective) while distkit's engine is up
            return inner(self, *a, **kw)

        trainer.TrainingRun.train_step = timed  # type: ignore[method-assign]
        rc = cli.main(argv)
        if rc != 0:
            return rc
        alt = holder["alt"]
        result["background_cpu_s"] = holder["threads"]
        if mode != "knob":
            result["a_checksum"] = holder["checksum"]
    else:
        import torch.nn.functional as F

        import distkit
        from distkit.tasks.charlm import SIZES, CharTransformer, datasets

        parser = distkit.add_arguments(argparse.ArgumentParser())  # ++key value, as byo_charlm.py takes them
        dk = distkit.init(parser.parse_args(argv), batch_size=args.batch_size)
        if mode == "aa":  # B is a second hand-written loop
            raw_b = build_raw(backend, args, names="aa.")
            step_b: Callable[[int], Any] = raw_b.step
        else:
            train, _, vocab = datasets(args.seq_len)
            width, layers, heads = SIZES[args.size]
            model = CharTransformer(vocab, args.seq_len, width, layers, heads)
            model, optimizer = dk.setup(model, torch.optim.SGD(model.parameters(), lr=args.lr))
            loader = dk.dataloader(train, batch_size=args.batch_size, shuffle=True)
            steps_per_epoch, state = len(loader), {"epoch": -1, "it": None}

            def step_b(i: int) -> Any:  # byo_charlm.py's step
                if i // steps_per_epoch != state["epoch"]:
                    state["epoch"] = i // steps_per_epoch
                    loader.set_epoch(state["epoch"])
                    state["it"] = iter(loader)
                x, y = next(state["it"])
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                dk.backward(loss)
                dk.step()
                return loss

        raw = build_raw(backend, args)
        alt = Alternator(spec["pairs"], spec["block"], raw.step)
        for i in range(alt.b_total):
            alt.tick()
            step_b(i)
        result["background_cpu_s"] = background_cpu()
        result["a_checksum"] = raw.checksum()
        if mode == "aa":
            result["b_checksum"] = raw_b.checksum()
        else:
            dk.finish()
            summary = dk.summary()  # collective (every rank): the bare model's checksum, gathered under ZeRO-3
            result["b_checksum"] = summary["param_checksum"]
            result["summary"] = {k: summary[k] for k in ("backend", "backend_impl", "launcher", "world_size")}
        dk.close()
    if launcher_rank() == 0:
        result.update(blocks=alt.blocks, a_steps=alt.a_step, torch_threads=torch.get_num_threads())
        with open(spec["times"], "w") as f:
            json.dump(result, f)
    return 0


# --------------------------------------------------------------------------- the parent
def pair_ratios(blocks: list[dict[str, Any]], warmup_pairs: int) -> dict[str, list[float]]:
    """B / A per pair (wall and CPU), the first ``warmup_pairs`` pairs left out."""
    by_pair: dict[int, dict[str, dict[str, float]]] = {}
    for b in blocks:
        by_pair.setdefault(b["pair"], {})[b["side"]] = b
    out: dict[str, list[float]] = {"wall": [], "cpu": []}
    for p in sorted(by_pair):
        if p < warmup_pairs or len(by_pair[p]) != 2:
            continue
        a, b = by_pair[p]["A"], by_pair[p]["B"]
        out["wall"].append(b["wall_s"] / a["wall_s"])
        out["cpu"].append(b["cpu_s"] / a["cpu_s"])
    return out


def summarize(ratios: dict[str, list[float]]) -> dict[str, Any]:
    return {m: {"median": statistics.median(v), "ci95": list(overhead.bootstrap_ci(v)), "n": len(v),
                "min": min(v), "max": max(v)} for m, v in ratios.items()}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [WORKER]:
        rest = argv[3:] if argv[2:3] == ["--"] else argv[2:]
        return worker(argv[1], rest)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="ddp", choices=sorted(overhead.BACKENDS))
    ap.add_argument("--path", default="cli", choices=["cli", "byo"])
    ap.add_argument("--aa", action="store_true", help="A/A: the hand-written loop against a copy of itself")
    ap.add_argument("--knob", default=None, choices=["preemption"],
                    help="(--path cli) A = distkit train with the feature off, B = on, switched per block")
    ap.add_argument("--pairs", type=int, default=60, help="A/B pairs, warm-up pairs included")
    ap.add_argument("--block", type=int, default=10, help="steps per block")
    ap.add_argument("--warmup-pairs", type=int, default=4, help="leading pairs left out of the statistics")
    ap.add_argument("--size", default="small", choices=["small", "medium", "large"])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--pin", action="store_true", help="each rank bound to its own core (workload.pin_rank)")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per rank (default cores // nprocs)")
    ap.add_argument("--threads-cpu", action="store_true",
                    help="record every thread's CPU seconds per block on rank 0 (blocks[i].threads_cpu_s): where a "
                         "side's time goes outside its main thread (Horovod's background thread, MPI progress, ...)")
    ap.add_argument("--run-timeout", type=float, default=900.0, metavar="SECONDS")
    ap.add_argument("--out", default=None, help="JSON path (default: a fresh directory under the temp directory)")
    args = ap.parse_args(argv)
    if args.pairs <= args.warmup_pairs + 4:
        ap.error("--pairs must exceed --warmup-pairs by at least 5")
    if args.block < 1:
        ap.error("--block must be at least 1")
    if args.knob and (args.aa or args.path != "cli"):
        ap.error("--knob runs distkit train against itself: --path cli, without --aa")
    if args.aa and args.path != "byo":
        ap.error("--aa runs the hand-written loop against itself: give --path byo (no distkit side is timed)")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.nprocs)
    be = overhead.BACKENDS[args.backend]
    mode = "aa" if args.aa else "knob" if args.knob else "ab"
    work = tempfile.mkdtemp(prefix="distkit-interleaved-")
    times = os.path.join(work, "times.json")
    workload = {k: getattr(args, k.replace("-", "_")) for k in ("size", "seq_len", "batch_size", "lr", "seed",
                                                                 "bucket_cap_mb", "zero_stage")}
    workload["steps"] = 0
    spec = {"backend": args.backend, "path": args.path, "mode": mode, "pairs": args.pairs, "block": args.block,
            "times": times, "workload": workload, "threads_cpu": args.threads_cpu}
    spec_path = os.path.join(work, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = be.launcher(args.nprocs) + [os.path.abspath(__file__), WORKER, spec_path, "--"]
    # side B's steps (with --knob: distkit's steps of both sides), one more whose start closes the last block
    b_steps = (2 if args.knob else 1) * args.pairs * args.block + 1
    if args.path == "cli":
        args.steps = b_steps
        cfg = overhead.distkit_config(be, args, os.path.join(work, "out"))
        cfg["checkpoint_every"] = None
        if args.knob == "preemption":
            cfg["preemption"] = True
        cfg_path = os.path.join(work, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
        cmd += ["train", cfg_path]
    else:
        cmd += overhead.byo_overrides(be, args)
    before = overhead.cpu_snapshot()
    t0 = time.perf_counter()
    overhead._run(cmd, overhead._env(args), os.path.join(work, "job.log"), args.run_timeout)
    wall = time.perf_counter() - t0
    load = overhead.foreign_load(before, overhead.cpu_snapshot())
    with open(times) as f:
        rec = json.load(f)
    if args.path == "cli":
        with open(os.path.join(work, "out", "summary.json")) as f:
            summary = json.load(f)
        rec["b_checksum"] = summary["param_checksum"]
        rec["summary"] = {k: summary[k] for k in ("backend_impl", "launcher", "steps", "compute_fraction")}
    same = rec.get("a_checksum") == rec.get("b_checksum") if mode != "knob" else None
    ratios = pair_ratios(rec["blocks"], args.warmup_pairs)
    result = {
        "benchmark": "interleaved", "backend": args.backend, "path": args.path, "mode": mode, "knob": args.knob,
        "config": {**workload, "nprocs": args.nprocs, "threads": args.threads, "pairs": args.pairs,
                   "block": args.block, "warmup_pairs": args.warmup_pairs, "pin": args.pin,
                   "launcher": be.launcher_name},
        "command": "python benchmarks/interleaved.py " + " ".join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": overhead.machine_info(),
        "job_wall_s": wall, "foreign_load_cpus": load, "same_work": same, "checksums": [rec.get("a_checksum"),
                                                                                          rec.get("b_checksum")],
        "distkit_steps": b_steps, "side_a_steps": rec["a_steps"],
        "pair_ratio": summarize(ratios), "pair_ratios": ratios, "blocks": rec["blocks"],
        # rank 0's background threads over the whole job (both sides' blocks and start-up), and as a share of it
        "background_cpu_s": rec["background_cpu_s"],
        "background_cpu_fraction": sum(rec["background_cpu_s"].values()) / max(wall, 1e-9),
        "summary": rec.get("summary"),
    }
    suffix = "_aa" if args.aa else f"_knob_{args.knob}" if args.knob else ""
    out = args.out or os.path.join(tempfile.mkdtemp(prefix="distkit-interleaved-results-"),
                                   f"interleaved_{args.backend}_{args.path}{suffix}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    r = result["pair_ratio"]
    print(f"interleaved {args.backend} {args.path}{suffix}: {len(ratios['wall'])} pairs of {args.block}-step blocks "
          f"in {wall:.0f} s (foreign load {load:.2f} CPUs): wall {r['wall']['median']:.4f} "
          f"({r['wall']['ci95'][0]:.4f}-{r['wall']['ci95'][1]:.4f}), cpu {r['cpu']['median']:.4f} "
          f"({r['cpu']['ci95'][0]:.4f}-{r['cpu']['ci95'][1]:.4f}); same work: {same}; distkit's background "
          f"threads: {sum(rec['background_cpu_s'].values()):.2f} CPU s on rank 0 "
          f"({100 * result['background_cpu_fraction']:.3f} % of the job's wall time)")
    print(out)
    if same is False:
        print("interleaved: the two sides ended with different parameters: they did not run the same work",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
