"""``distkit`` command line; ``python -m distkit`` is the same.

Bad input (config, flags, files) prints one line ``distkit: error: ...`` on stderr and
exits with status 2 before anything is written. A failure during training exits 1 and
names the rank.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from typing import Any, NoReturn, Optional

from distkit.backends import startup
from distkit.config import LaunchFlags, RunConfig, load_config, split_overrides
from distkit.errors import CollectiveTimeout, ConfigError, DistkitError, describe, report_agreed
from distkit.launch.spawner import record_failure, settle_if_peer
from distkit.health import faults
from distkit.health.lost import lost_peer_error

EPILOG = """\
config keys: any top-level key of a config file can be set with ++key value (a Python
literal, else JSON, else a string), nested keys with ++distributed.reduce_type param.
`distkit keys` lists every key with its default and meaning.
examples:
  distkit train configs/returnn_ddp.py --nprocs 2
  torchrun --nproc_per_node 2 -m distkit train configs/speechbrain.yaml ++num_epochs 3
  mpirun -np 2 .venv/bin/distkit train configs/returnn_ddp.py
  deepspeed --num_accelerators 2 --module distkit train cfg.py --deepspeed --deepspeed_config ds.json
  distkit export runs/x/checkpoints/step-0000040 model.pt
  distkit convert runs/x state.pt
  distkit inspect runs/x                      # what the latest checkpoint holds; is it intact
  distkit sbatch configs/returnn_ddp.py --nodes 2 --ntasks-per-node 4 --submit
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, status 2 (argparse would print usage + text)
        raise ConfigError(f"{message} (see `{self.prog} --help`)")


#: the subcommands beyond ``train`` and ``keys``, each in its own module with ``add_parser(sub)`` and
#: ``run(args)`` (``sbatch``: ``run(args, overrides)``)
COMMANDS = {"inspect": "distkit.commands.inspection", "export": "distkit.commands.export", "convert": "distkit.commands.convert",
            "sbatch": "distkit.commands.sbatch", "lighthouse": "distkit.commands.lighthouse", "env": "distkit.commands.envreport",
            "plot": "distkit.commands.plot"}


def _command(rest: list[str]) -> Optional[str]:
    """The subcommand ``rest`` names (its first word that is one), None for none."""
    return next((w for w in rest if w in COMMANDS or w in ("train", "keys")), None)


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The command line's parser. With ``command`` (one of :data:`COMMANDS`, ``train`` or ``keys``) only that
    subcommand's module is imported: export, inspect and convert import torch (about 1.5 s here), and a
    command that needs none of it (``train`` refusing a bad config with exit 2, ``lighthouse``, ``keys``)
    should not wait for it. None (``distkit --help``, or no known command named): every subcommand."""
    parser = _Parser(prog="distkit", description="Data-parallel PyTorch training on DDP, DeepSpeed, Horovod or MPI.",
                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG, allow_abbrev=False)
    # torch.distributed.launch and the deepspeed launcher put --local-rank=N before the module's
    # own arguments, i.e. before "train": accept it at the top level too.
    parser.add_argument("--local_rank", "--local-rank", dest="top_local_rank", type=int, default=None,
                        help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    # allow_abbrev=False: "--nproc 2" must be an error, not silently --nprocs
    t = sub.add_parser("train", help="train from config files", epilog=EPILOG, allow_abbrev=False,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Train from one or more config files (.py, .yaml, .json); later files and "
                                   "++key value overrides win.")
    t.add_argument("configs", nargs="+", metavar="CONFIG", help="config files (.py RETURNN style, .yaml, .json)")
    t.add_argument("--nprocs", type=int, default=None, metavar="N",
                   help="start N local ranks (ignored under torchrun/mpirun/srun); same as ++nprocs N")
    t.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None, metavar="N",
                   help="local rank passed by the deepspeed launcher / torch.distributed.launch")
    t.add_argument("--distributed_backend", choices=["gloo", "nccl", "mpi"], default=None,
                   help="torch.distributed backend (SpeechBrain's flag); default nccl on CUDA else gloo")
    t.add_argument("--distributed_launch", action="store_true",
                   help="accepted for SpeechBrain scripts; no effect (the launcher is detected)")
    t.add_argument("--find_unused_parameters", action="store_true",
                   help="pass find_unused_parameters=True to DistributedDataParallel")
    t.add_argument("--deepspeed", action="store_true", help="use the DeepSpeed backend")
    t.add_argument("--deepspeed_config", default=None, metavar="JSON", help="DeepSpeed config file (implies --deepspeed)")
    k = sub.add_parser("keys", help="list every config key with its default and meaning", allow_abbrev=False)
    k.add_argument("pattern", nargs="?", default="", help="only keys containing this text")
    k.add_argument("--markdown", action="store_true",
                   help="print a Markdown document (one table of every key, then the seed spellings): docs/config.md")
    for name, module in COMMANDS.items():
        if command in (None, name):
            importlib.import_module(module).add_parser(sub)
    return parser


def _print_keys(pattern: str, markdown: bool = False) -> int:
    """Every config key (``distkit keys [TEXT] [--markdown]``): name, default, meaning; then the seed spellings."""
    import signal
    import textwrap

    from distkit.config.schema import ALIAS_KEYS, key_docs, keys_markdown

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `distkit keys | head` ends quietly

    rows = [r for r in key_docs() if pattern in r[0]]
    if not rows and not any(pattern in a for a in ALIAS_KEYS):
        raise ConfigError(f"no config key contains {pattern!r}: run `distkit keys` for all of them")
    if markdown:
        sys.stdout.write(keys_markdown(pattern))
        return 0
    width = max((len(k) for k, _, _ in rows), default=0)
    for key, default, meaning in rows:
        shown = default if not callable(default) else getattr(default, "__name__", default)
        print(f"{key:<{width}}  = {shown!r}")
        for line in textwrap.wrap(meaning.replace("``", "`"), 88):
            print(f"{'':<{width}}    {line}")
    aliases = [a for a in ALIAS_KEYS if pattern in a]
    if aliases:
        print("\nseed spellings, folded into the keys above (RETURNN, SpeechBrain, perceptrain, DeepSpeed):")
        print(textwrap.fill(", ".join(aliases), 88, initial_indent="  ", subsequent_indent="  "))
    return 0


#: this process only started the ranks (``--nprocs``) and waited for them: ``python -m distkit`` then
#: exits without the interpreter's teardown (0.4-0.8 s of freeing torch's modules on a 2-core machine,
#: per run); it holds no engine, no open file and no thread whose end matters
launched_only = False
#: this process trained as a rank of a job (or alone): its outputs are written and closed, its engine torn down
#: (``Session.close``). ``python -m distkit`` then ends like a forked rank (:func:`distkit.launch.forkrank.end_process`:
#: ``atexit`` handlers, the MPI library's finalize, no teardown of the interpreter's modules), where the teardown
#: of torch's 2000 modules took 2.5-5 s of CPU per rank on this 2-core machine: the mpi engine's launchers exited
#: that much after ``summary.json`` (issue 36 item 20; ddp's forked ranks skipped it already)
trained = False


def _print_summary(summary: dict[str, Any]) -> None:
    width = max(len(k) for k in summary)
    lines = ["", "summary", "-" * (width + 40)]
    for k, v in summary.items():
        lines.append(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    print("\n".join(lines), flush=True)


def _model_shapes(cfg: RunConfig) -> Optional[dict[str, list[int]]]:
    """The model's tensor shapes, built on the meta device (no memory, no data); None if it cannot be."""
    import torch

    from distkit.checkpoint import model_shapes
    from distkit.tasks import TASKS

    try:
        factory = cfg.model if cfg.model is not None else TASKS[str(cfg.task)](cfg).model_fn
        with torch.device("meta"):
            return model_shapes(factory())
    except Exception:  # a factory that needs real tensors: the ranks check the shapes before loading
        return None


def _as_rank(argv: list[str]) -> int:
    """A rank forked from the launching process (:mod:`distkit.launch.forkrank`): what ``python -m distkit
    ARGV`` does in a new interpreter with the rank's environment."""
    global launched_only
    launched_only = False
    return main(argv)


def train(args: argparse.Namespace, overrides: list[tuple[str, Any]], argv: list[str]) -> int:
    """``distkit train``: the run of :func:`_train`, and the output_dir lock it took released when it ends
    (``main()`` may be called in a process that goes on; the ``distkit`` command exits anyway)."""
    if args.local_rank is None:
        args.local_rank = args.top_local_rank
    # torch's C++ warnings (read once, when torch loads: before the config file, which may import it): when a rank
    # dies, its peers' TCPStore clients print a 22-line C++ backtrace each before distkit's line naming the rank
    # that died. Errors still print; TORCH_CPP_LOG_LEVEL=WARNING (or INFO) in the environment shows them again.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    flags = LaunchFlags(local_rank=args.local_rank, distributed_backend=args.distributed_backend,
                        find_unused_parameters=args.find_unused_parameters, deepspeed=args.deepspeed,
                        deepspeed_config=args.deepspeed_config, nprocs=args.nprocs)
    cfg: RunConfig = load_config(args.configs, overrides, flags)
    faults.check()  # a DISTKIT_FAULT that is no fault spec: one line, not a traceback at import
    from distkit.checkpoint import holds_lock, unlock_output_dir

    held = holds_lock(cfg.output_dir)  # a rank forked from the launching process: its lock, not this call's
    try:
        return _train(args, cfg, argv)
    finally:
        if not held:
            unlock_output_dir(cfg.output_dir)


def _local_rank_0_ended(timeout_s: float = 10.0) -> bool:
    """Whether this node's local rank 0 (a process of the same launcher: a sibling of this one) ended within
    ``timeout_s``: a rank that leaves the line of a finding every rank makes to it waits for that first, since a
    launcher ends the job at its first failed rank and could stop local rank 0 before its line. False (then this
    rank prints the line itself) when it is still running (it found nothing) or cannot be found."""
    import time

    from distkit.env import detect
    from distkit.launch import procfs

    peers = []
    for pid in procfs.children(os.getppid()):
        environ = procfs.environ(pid) if pid != os.getpid() else None
        try:
            if environ is not None and detect(environ).local_rank == 0:
                peers.append(pid)
        except DistkitError:  # (not a rank: its variables make no layout)
            pass
    if not peers:
        return False
    end = time.monotonic() + timeout_s
    while peers and time.monotonic() < end:
        peers = [p for p in peers if procfs.state(p) not in (None, "Z", "X")]
        if peers:
            time.sleep(0.05)
    return not peers


def _train(args: argparse.Namespace, cfg: RunConfig, argv: list[str]) -> int:
    from distkit.backends import check_backend, strategy_class
    from distkit.env import check_launched, detect
    from distkit.tasks import check_task

    from distkit.components import check_components

    check_task(cfg)
    check_backend(cfg)  # bad input fails here, before any rank starts or anything is written
    check_components(cfg)

    environ = dict(os.environ)
    if args.local_rank is not None:  # old torch.distributed.launch passes it only as an argument
        environ.setdefault("LOCAL_RANK", str(args.local_rank))
    env = detect(environ)
    check_launched(env, environ)  # a leftover RANK/WORLD_SIZE: one line now, not a wait for ranks that never come
    if env.launcher == "single" and cfg.nprocs > 1 and cfg.device != "cpu":
        import torch

        from distkit.components import ranks_per_gpu_problem

        # (device_count does not initialise CUDA: the ranks may still be forks of this process)
        problem = ranks_per_gpu_problem(cfg.device, cfg.nprocs, torch.cuda.device_count())
        if problem is not None:
            raise ConfigError(problem)
    from distkit import trackers
    from distkit.checkpoint import preflight

    trackers.check_reachable(cfg.loggers)  # an unreachable MLflow server: one line now, not minutes later

    # an unwritable output_dir, or a resume that cannot work (damaged, other world size, other model):
    # one line and exit 2 here, before any rank starts and before anything is written
    # Started without a launcher, this process owns the whole run (it trains, or starts and outlives the
    # ranks): it takes output_dir's lock here, so a second run on the same output_dir stops with one line
    # before anything is written. Under torchrun/mpirun/srun rank 0 takes it in the Trainer.
    try:
        verified = preflight(cfg, cfg.nprocs if env.launcher == "single" else env.world_size, lambda: _model_shapes(cfg),
                             lock=env.launcher == "single")
    except DistkitError as e:
        # under a launcher every rank checks the same output_dir and finds the same: one line per node, from its
        # local rank 0 (was one per rank); the others end quietly with the same status
        if env.launcher != "single" and env.local_rank != 0 and _local_rank_0_ended():
            e.reported = True
        raise
    if env.launcher == "single" and cfg.nprocs > 1:
        from distkit.checkpoint import LOCK_ENV, TRUSTED_ENV
        from distkit.launch.spawner import run_local

        if verified is not None:  # the ranks started here need not hash the same files again (seconds per GB)
            os.environ[TRUSTED_ENV] = os.path.abspath(verified)
        os.environ[LOCK_ENV] = os.path.abspath(cfg.output_dir)  # held here: the ranks must not take it again
        global launched_only
        try:
            launched_only = True
            engine = strategy_class(cfg.distributed.backend)
            return run_local([sys.executable, "-m", "distkit", *argv], cfg.nprocs, engine.local_launcher,
                             target=lambda: _as_rank(argv), preemptible=cfg.preemption,
                             preimport=engine.before_forks(cfg) if engine.local_launcher == "spawn" else ())
        finally:
            os.environ.pop(TRUSTED_ENV, None)
            os.environ.pop(LOCK_ENV, None)
    from distkit.trainer import Trainer

    global trained
    trained = True
    try:
        summary = Trainer(cfg, env).fit()
    except DistkitError as e:
        if e.exit_code == 2 and env.world_size == 1:  # bad input in a single process: main prints the one line
            raise
        record_failure(env.rank, e)
        if e.agreed:  # every rank stops with this same error: one line, from rank 0 (Trainer.fit printed it)
            report_agreed(e, env.rank)
            return e.exit_code
        print(f"distkit: rank {env.rank} failed: {describe(e)}", file=sys.stderr, flush=True)
        settle_if_peer(e, env.world_size)
        return e.exit_code
    except Exception as e:  # a bug or a runtime failure: the traceback helps, the rank must be named
        record_failure(env.rank, e)
        lost = lost_peer_error(e)
        timed_out = lost is None and ("timed out" in str(e).lower() or "timeout" in type(e).__name__.lower())
        if lost is None and not (timed_out and cfg.fault_tolerance):
            # a peer that is gone is the cause, not where this rank noticed it: no traceback then; nor in a
            # fault-tolerant group, whose timed-out collective is one line naming the group and how to go on
            traceback.print_exc()
        e = lost or e  # a peer is gone: name it, not the address the engine's message has
        if timed_out:
            ft = cfg.fault_tolerance
            e = CollectiveTimeout(f"a collective timed out after {startup.bound_text(cfg.distributed)}: "
                                  "another rank hung or died (see its output)" + (
                                      f", or this replica group ({ft['replica_id']}) was stopped longer than that: run "
                                      "its command again with ++resume auto, and it heals from the live groups at its "
                                      "first sync" if ft else ""))
        print(f"distkit: rank {env.rank} failed: {describe(e)}", file=sys.stderr, flush=True)
        settle_if_peer(e, env.world_size)
        return 1
    if env.rank == 0:
        _print_summary(summary)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        rest, overrides = split_overrides(argv)
        args = build_parser(_command(rest)).parse_args(rest)
        if args.command is None:
            build_parser().print_help()
            return 2
        if args.command == "keys":
            return _print_keys(args.pattern, args.markdown)
        if args.command == "sbatch":
            from distkit.commands.sbatch import run as sbatch

            return sbatch(args, overrides)
        if args.command in COMMANDS:
            return importlib.import_module(COMMANDS[args.command]).run(args)  # type: ignore[no-any-return]
        return train(args, overrides, argv)
    except DistkitError as e:
        if not e.reported:  # (another rank of the job printed the same line)
            print(f"distkit: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code


def entry() -> NoReturn:
    """The ``distkit`` command and ``python -m distkit``: :func:`main`, then exit with its status. A
    process that only launched the ranks (:data:`launched_only`) skips the interpreter's teardown."""
    code = main()
    if launched_only:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if trained:
        from distkit.launch.forkrank import end_process

        end_process(code)
    sys.exit(code)
