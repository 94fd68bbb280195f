"""``distkit sbatch CONFIG``: a SLURM batch script that runs ``distkit train CONFIG`` on N nodes.

    distkit sbatch configs/returnn_ddp.py --nodes 2 --ntasks-per-node 4 [--partition P] [--time 1:00:00]
                   [--engine ddp|deepspeed|mpi|horovod] [--dry-run | --submit] [++key value ...]

The script requests the nodes and tasks, takes the first host of the allocation as the rendezvous
address (``scontrol show hostnames``), derives the port from the job id (two jobs on one node get
different ports), and gives every job its own output directory (``<output_dir>/job-<id>``, SLURM's
log ``slurm-<id>.out`` beside it). DDP and DeepSpeed start one task per rank with ``srun`` (distkit
reads the rank layout from SLURM); the mpi engine and Horovod start under ``mpirun`` inside the
allocation (Open MPI reads the allocation from SLURM). ``--bind-to none`` keeps Open MPI from binding
every rank of a node to one core.

Under ``fault_tolerance`` (torchft replica groups) it writes one script per group, ``<job name>-group-i``,
each running group ``i`` (``fault_tolerance.replica_id = i``) as a job of its own: a group that is
preempted, requeued (``--requeue``) or fails is one job, and the others go on. The lighthouse runs
elsewhere (``distkit lighthouse``, on a host every node reaches).

``--dry-run`` prints the script and writes nothing; ``--submit`` writes it and submits it with
``sbatch``; with neither, it is written and its path printed. The config is loaded and checked
first: a bad config or flag is one line and exit status 2, nothing written.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import Any

from distkit.config.schema import KNOWN_BACKENDS
from distkit.errors import ConfigError, UsageError

ENGINES = KNOWN_BACKENDS


def add_parser(sub: Any) -> None:
    p = sub.add_parser("sbatch", help="write (and submit) a SLURM batch script for a training run", allow_abbrev=False,
                       description=(__doc__ or "").split("\n\n")[0].strip() + " Overrides (++key value) pass through.")
    p.add_argument("configs", nargs="+", metavar="CONFIG", help="config files, as for `distkit train`")
    p.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes to allocate (default 1)")
    p.add_argument("--ntasks-per-node", dest="ntasks_per_node", type=int, default=1, metavar="M",
                   help="ranks per node (default 1)")
    p.add_argument("--partition", default=None, metavar="P", help="SLURM partition (default: the cluster's)")
    p.add_argument("--time", default=None, metavar="T", help="time limit, SLURM syntax (e.g. 1:00:00)")
    p.add_argument("--engine", choices=ENGINES, default=None, help="distributed.backend (default: the config's)")
    p.add_argument("--job-name", dest="job_name", default=None, help="job name (default distkit-<config name>)")
    p.add_argument("--script", default=None, metavar="PATH",
                   help="where to write the script (default <output_dir>/distkit-<job name>.sbatch)")
    p.add_argument("--requeue", action="store_true",
                   help="on preemption or near the time limit (SIGUSR1 90 s before it) the run stops with a checkpoint "
                        "and the job is requeued; it continues with ++resume auto (distkit.health.preemption)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", dest="dry_run", action="store_true", help="print the script, write nothing")
    mode.add_argument("--submit", action="store_true", help="write the script and submit it with sbatch")


def scripts(args: argparse.Namespace, overrides: list[tuple[str, Any]]) -> tuple[list[tuple[str, str]], str]:
    """``([(job name, script text)], output base directory)``: one script, or under ``fault_tolerance`` one per
    replica group (its own job: a group preempted, requeued or failed is a job of its own, as torchft wants;
    group ``i`` runs with ``fault_tolerance.replica_id = i`` and writes ``$OUT/group-i``). ConfigError for bad
    input."""
    from distkit.config import load_config

    if args.nodes < 1 or args.ntasks_per_node < 1:
        raise ConfigError(f"--nodes and --ntasks-per-node must be at least 1 (got {args.nodes} and {args.ntasks_per_node})")
    if args.time is not None and not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}", args.time):
        raise ConfigError(f"--time {args.time!r} is not a SLURM time (minutes, H:MM:SS or D-HH:MM:SS)")
    configs = [os.path.abspath(c) for c in args.configs]
    extra = list(overrides)
    if args.engine is not None:
        extra.append(("distributed.backend", args.engine))
    cfg = load_config(configs, extra)  # checks files, keys and values now, before anything is written
    engine = cfg.distributed.backend
    ft = cfg.fault_tolerance
    # under fault_tolerance the loaded output_dir is already the group's (<output_dir>/group-i)
    base = os.path.abspath(os.path.dirname(cfg.output_dir) if ft else cfg.output_dir)
    name = args.job_name or f"distkit-{os.path.splitext(os.path.basename(configs[0]))[0]}"
    if not re.fullmatch(r"[\w.-]+", name):
        raise ConfigError(f"--job-name {name!r}: use letters, digits, '.', '_' and '-'")
    # the overrides as values distkit parses back to the same thing (repr of a literal is a literal)
    if args.requeue and not cfg.preemption:
        raise ConfigError("--requeue needs preemption = True (the run must stop with a checkpoint on the signal): "
                          "remove ++preemption False, or --requeue")
    pass_on = [tok for key, value in extra if key not in ("output_dir", "fault_tolerance")
               for tok in (f"++{key}", _token(value))]
    if not any(key == "resume" for key, _ in extra):
        # a requeued job (same job id, same OUT: --requeue's, a preemption's, an admin's scontrol requeue)
        # continues its own checkpoint; the first attempt starts afresh (no checkpoint in OUT yet)
        pass_on += ["++resume", "auto"]
    if not ft:
        return [(name, _text(args, engine, base, name, configs, pass_on))], base
    return [(f"{name}-group-{i}", _text(args, engine, base, f"{name}-group-{i}", configs,
                                     ["++fault_tolerance", repr({**ft, "replica_id": i}), *pass_on]))
            for i in range(int(ft["num_replicas"]))], base


def _text(args: argparse.Namespace, engine: str, base: str, name: str, configs: list[str],
          pass_on: list[str]) -> str:
    """One batch script: ``distkit train CONFIGS ++output_dir $OUT PASS_ON`` on the allocation."""
    train = [sys.executable, "-m", "distkit", "train", *configs]
    train_line = " ".join(shlex.quote(a) for a in train) + ' ++output_dir "$OUT"' + \
        "".join(" " + shlex.quote(a) for a in pass_on)
    if engine in ("mpi", "horovod"):
        run = f'mpirun -np "$SLURM_NTASKS" --bind-to none {train_line}'
    else:
        run = f"srun --kill-on-bad-exit=1 {train_line}"
    # --open-mode=append: a requeued attempt's log follows the one before it (SLURM's default replaces it); each
    # attempt starts with its own line (below)
    heads = [f"--job-name={name}", f"--nodes={args.nodes}", f"--ntasks-per-node={args.ntasks_per_node}",
             f"--output={base}/slurm-%j.out", "--open-mode=append"]
    if args.partition:
        heads.append(f"--partition={args.partition}")
    if args.time:
        heads.append(f"--time={args.time}")
    if args.requeue:
        # USR1 to the batch shell 90 s before the time limit; the shell passes it on to the run (below)
        heads += ["--requeue", "--signal=B:USR1@90"]
    from distkit import __version__

    text = "\n".join([
        "#!/bin/bash",
        f"# written by distkit {__version__} sbatch on {datetime.date.today().isoformat()}: "
        f"{engine}, {args.nodes} node(s) x {args.ntasks_per_node} rank(s)",
        *(f"#SBATCH {h}" for h in heads),
        "set -euo pipefail",
        "# rendezvous: the allocation's first host; a port of this job's own (20000-29999)",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        'export MASTER_PORT="$((20000 + SLURM_JOB_ID % 10000))"',
        f'OUT={shlex.quote(base)}/job-"$SLURM_JOB_ID"',
        'echo "distkit: job $SLURM_JOB_ID, attempt $((${SLURM_RESTART_COUNT:-0} + 1)), on $(hostname), $(date -u)"',
        f"cd {shlex.quote(os.getcwd())}",
        *(_requeue_lines(run) if args.requeue else [run]),
        *(_completed_lines() if engine in ("mpi", "horovod") else []),
        "",
    ])
    return text


def _requeue_lines(run: str) -> list[str]:
    """The run in the background, SIGUSR1/SIGTERM to this shell passed on to it (``scancel --batch --signal``,
    ``--signal=B:USR1@90``), and a requeue of this job when it stopped for that (exit status 75)."""
    return [
        "# a preemption notice reaches this shell: pass it on; the run stops after an agreed step with a",
        "# checkpoint and exits with 75, and the job is requeued (same job id: it continues in $OUT).",
        "# (srun may report another status when it ends the last rank a moment after the first left: the",
        "# notice itself decides)",
        f"{run} &",
        "pid=$!",
        "notice=0",
        "trap 'notice=1; kill -USR1 \"$pid\" 2>/dev/null || true' USR1 TERM",
        "rc=0",
        'while kill -0 "$pid" 2>/dev/null; do wait "$pid" && rc=0 || rc=$?; done',
        'if [ "$rc" -eq 75 ] || { [ "$notice" -eq 1 ] && [ "$rc" -ne 0 ]; }; then scontrol requeue "$SLURM_JOB_ID"; exit 0; fi',
        '[ "$rc" -eq 0 ] || exit "$rc"',
    ]


def _completed_lines() -> list[str]:
    """After ``mpirun`` exited 0: the run must have completed (its ``summary.json``), since Open MPI 5's mpirun
    exits 0 about half the time when a host's ranks died together with its daemon (docs/multinode.md)."""
    return [
        "# mpirun exits 0 about half the time when a host died with its ranks: only summary.json says the run ended",
        '[ -f "$OUT/summary.json" ] || { echo "distkit: mpirun exited 0 but the run did not complete (no '
        '$OUT/summary.json: ranks were lost, e.g. with a host); exiting 1" >&2; exit 1; }',
    ]


def _token(value: Any) -> str:
    """An override value as a command-line token that distkit parses back to ``value``."""
    from distkit.config import parse_value

    return value if isinstance(value, str) and parse_value(value) == value else repr(value)


def run(args: argparse.Namespace, overrides: list[tuple[str, Any]]) -> int:
    texts, base = scripts(args, overrides)
    if args.dry_run:
        print("".join(text for _, text in texts), end="")
        return 0
    if args.submit and shutil.which("sbatch") is None:
        raise UsageError("--submit needs SLURM's sbatch on PATH (this machine has none); write the script without "
                         "--submit and submit it where SLURM runs")
    paths = []
    for name, text in texts:
        if args.script:  # one path given, several groups: group i's script gets "-group-i" before the extension
            stem, ext = os.path.splitext(args.script)
            path = os.path.abspath(args.script if len(texts) == 1 else f"{stem}{name[name.rindex('-group-'):]}{ext}")
        else:
            path = os.path.join(base, f"{name}.sbatch")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".part", "w") as f:
            f.write(text)
        os.chmod(path + ".part", 0o755)
        os.replace(path + ".part", path)
        paths.append(path)
    if not args.submit:
        for path in paths:
            print(f"distkit: wrote {path}; submit it with: sbatch {path}")
        return 0
    for path in paths:
        res = subprocess.run(["sbatch", "--parsable", path], capture_output=True, text=True)
        if res.returncode != 0:
            raise UsageError(f"sbatch refused {path}: {res.stderr.strip() or res.stdout.strip()}")
        job = res.stdout.strip().split(";")[0]
        print(f"distkit: submitted job {job} ({path}); output in {base}/job-{job}, SLURM's log {base}/slurm-{job}.out")
    return 0
