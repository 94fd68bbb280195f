"""The SpeechBrain bridge's join: distkit's flags out of SpeechBrain's ``sys.argv`` (at import), the job joined at
SpeechBrain's ``ddp_init_group`` (or when the Brain is made), and SpeechBrain's helpers (``run_on_main``,
``if_main_process``, ``main_process_only``, ``ddp_barrier``, ``ddp_broadcast``, ``ddp_all_reduce``) routed to the
engine's collectives. The Brain is :mod:`distkit.integrations.speechbrain`; see its docstring."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Optional

import torch

from distkit.config.arguments import CONFIGS_DEST, OVERRIDES_DEST
from distkit.config.loader import split_overrides
from distkit.errors import BackendUnavailable, ConfigError, DistkitError, UnsupportedCombination, UsageError
from distkit.health.guards import install_excepthook
from distkit.integrations.replicas import rng_kept
from distkit.session import Session

try:
    import speechbrain as _sb
    import speechbrain.utils.distributed as _sbdist
except ImportError:
    raise BackendUnavailable("distkit.speechbrain needs SpeechBrain: pip install 'distkit[speechbrain]'") from None


# -- distkit's flags, out of SpeechBrain's argv -------------------------------------------------------------------
def _take_flags(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """distkit's flags (``--config``, ``--nprocs``, ``--deepspeed``, ``--deepspeed_config``, ``++key value``) out of
    ``argv``; the rest for SpeechBrain's parser. SpeechBrain's own ``--distributed_backend`` stays (it is read there)."""
    rest, pairs = split_overrides(list(argv))
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--config", dest=CONFIGS_DEST, nargs="+", action="extend", default=[])
    parser.add_argument("--nprocs", type=int, default=None)
    parser.add_argument("--deepspeed", action="store_true")
    parser.add_argument("--deepspeed_config", default=None)
    ns, rest = parser.parse_known_args(rest)
    setattr(ns, OVERRIDES_DEST, pairs)
    return ns, rest


_FLAGS, _rest = _take_flags(sys.argv[1:])
sys.argv[1:] = _rest  # (sys.orig_argv keeps them for the --nprocs relaunch)


def _hparams_block(path: Optional[str]) -> dict[str, Any]:
    """The ``distributed:`` block of a HyperPyYAML file, read as plain YAML (its other entries may hold tags that
    build objects, so the file is not loaded whole); {} without one. Bad YAML in the block: ConfigError."""
    import yaml

    if not path or not os.path.isfile(path):
        return {}
    lines, inside = [], False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("distributed:"):
                inside = True
            elif inside and line.strip() and not line[0].isspace() and not line.lstrip().startswith("#"):
                break
            if inside:
                lines.append(line)
    if not lines:
        return {}
    try:
        block = yaml.safe_load("".join(lines)).get("distributed")
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: the distributed: block is not plain YAML ({str(e).splitlines()[0]}): give plain "
                          "values there (backend: mpi, reduce_type: param, ...)") from None
    if block is None:
        return {}
    if not isinstance(block, dict):
        raise ConfigError(f"{path}: distributed: must be a mapping (backend: mpi, reduce_type: param, ...), got "
                          f"{type(block).__name__}")
    return block


def run_option(run_opts: Any, name: str) -> Any:
    """A SpeechBrain run option from a RunOptions or a dict (None when absent)."""
    if run_opts is None:
        return None
    if isinstance(run_opts, dict):
        return run_opts.get(name)
    return getattr(run_opts, name, None)


def given_option(run_opts: Any, name: str) -> bool:
    """Whether the command line set run option ``name`` (a dict's keys all count)."""
    if isinstance(run_opts, dict):
        return name in run_opts
    return name in getattr(run_opts, "overridden_args", set())


# -- joining the job -------------------------------------------------------------------------------------------------
_SESSION: Optional[Session] = None


def join(run_opts: Any = None, hparams: Optional[dict[str, Any]] = None) -> Session:
    """Collective, once per process: ``distkit.init`` with distkit's flags from the command line, the hparams
    file's ``distributed:`` block (or ``hparams["distributed"]``) and SpeechBrain's ``--distributed_backend``;
    the random streams stay the recipe's. Under plain ``python`` with ``--nprocs N`` this does not return in the
    launching process (as :func:`distkit.init`). Then SpeechBrain's helpers run on the engine's collectives."""
    global _SESSION, _DISTKIT_HOOK
    if _SESSION is not None:
        return _SESSION
    install_excepthook(lambda: Session.current)  # (distkit.init's own: the refusals below come before it)
    _DISTKIT_HOOK = sys.excepthook
    import distkit

    block = dict(hparams["distributed"]) if hparams and isinstance(hparams.get("distributed"), dict) else \
        _hparams_block(run_option(run_opts, "param_file"))
    ns = argparse.Namespace(**vars(_FLAGS))
    setattr(ns, OVERRIDES_DEST, [(f"distributed.{k}", v) for k, v in block.items()] + list(getattr(_FLAGS, OVERRIDES_DEST)))
    ns.local_rank = None
    ns.distributed_backend = run_option(run_opts, "distributed_backend") if given_option(run_opts, "distributed_backend") else None
    refuse_data_parallel(run_opts)
    with rng_kept():
        _SESSION = distkit.init(ns)
    _route(_SESSION)
    return _SESSION


#: distkit's excepthook, as :func:`join` found it installed (a DistkitError: its one line and exit status)
_DISTKIT_HOOK: Optional[Callable[..., Any]] = None


def distkit_errors_first() -> None:
    """On SpeechBrain's main process ``create_experiment_directory`` replaces ``sys.excepthook`` with its own
    (``_logging_excepthook``, speechbrain/core.py), which logs a traceback and leaves with exit 1, so a refusal
    after it (a Brain's) would be a traceback on rank 0 instead of distkit's one line and exit 2. Puts a hook in
    front: DistkitErrors to distkit's hook, everything else to the hook in place (SpeechBrain's logging).
    Idempotent; nothing to do before :func:`join` or while distkit's hook is still the one."""
    current = sys.excepthook
    if _DISTKIT_HOOK is None or current is _DISTKIT_HOOK or getattr(current, "distkit_errors_first", False):
        return
    distkit_hook = _DISTKIT_HOOK

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        (distkit_hook if isinstance(exc, DistkitError) else current)(kind, exc, tb)

    hook.distkit_errors_first = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def refuse_data_parallel(run_opts: Any) -> None:
    """SpeechBrain's ``--data_parallel_backend`` (torch's DataParallel in one process): UnsupportedCombination."""
    if run_option(run_opts, "data_parallel_backend"):
        raise UnsupportedCombination("distkit.speechbrain.Brain with --data_parallel_backend (torch's DataParallel, "
                                     "one process): leave the flag out; distkit's engines run one process per device")


def ddp_init_group(run_opts: Any = None) -> None:
    """SpeechBrain's ``sb.utils.distributed.ddp_init_group(run_opts)``, the point where a recipe joins its job:
    :func:`join` (collective), so that the recipe's data preparation (``run_on_main``) runs once, on rank 0,
    under every engine and launcher. Installed in SpeechBrain's module when this module is imported."""
    join(run_opts)


# -- SpeechBrain's helpers on the engine's collectives ------------------------------------------------------------
_ORIGINAL = {name: getattr(_sbdist, name) for name in (
    "is_distributed_initialized", "if_main_process", "is_local_rank_zero", "ddp_barrier", "ddp_broadcast",
    "ddp_all_reduce", "ddp_init_group", "get_rank")}

_OPS = {"SUM": "sum", "AVG": "mean", "MAX": "max", "MIN": "min"}


def _is_initialized() -> bool:
    return _SESSION.world_size > 1 if _SESSION is not None else _ORIGINAL["is_distributed_initialized"]()


def _if_main_process() -> bool:
    return _SESSION.is_main if _SESSION is not None else _ORIGINAL["if_main_process"]()


def _is_local_rank_zero() -> bool:
    return _SESSION.local_rank == 0 if _SESSION is not None else _ORIGINAL["is_local_rank_zero"]()


def _get_rank() -> Optional[int]:
    return _SESSION.rank if _SESSION is not None else _ORIGINAL["get_rank"]()


def _ddp_barrier() -> None:
    if _SESSION is None:
        return _ORIGINAL["ddp_barrier"]()
    if not _sbdist.ddp_prevent_block():  # (inside main_process_only: the other ranks never come)
        _SESSION.barrier()


def _ddp_broadcast(communication_object: Any, src: int = 0) -> Any:
    if _SESSION is None:
        return _ORIGINAL["ddp_broadcast"](communication_object, src)
    if _sbdist.ddp_prevent_block():
        return communication_object
    return _SESSION.broadcast_object(communication_object, src)


def _ddp_all_reduce(communication_object: torch.Tensor, reduce_op: Any) -> torch.Tensor:
    """In place, as torch.distributed.all_reduce (SpeechBrain's InputNormalization sums its statistics)."""
    if _SESSION is None:
        return _ORIGINAL["ddp_all_reduce"](communication_object, reduce_op)
    if _sbdist.ddp_prevent_block():
        return communication_object
    name = str(getattr(reduce_op, "name", reduce_op)).rsplit(".", 1)[-1].upper()
    if name not in _OPS:
        raise UsageError(f"ddp_all_reduce with {reduce_op}: distkit's engines reduce with SUM, AVG, MAX or MIN")
    with torch.no_grad():
        communication_object.copy_(_SESSION.all_reduce(communication_object.clone(), _OPS[name]))
    return communication_object


_ROUTED: dict[str, Callable[..., Any]] = {
    "is_distributed_initialized": _is_initialized, "if_main_process": _if_main_process,
    "is_local_rank_zero": _is_local_rank_zero, "ddp_barrier": _ddp_barrier, "ddp_broadcast": _ddp_broadcast,
    "ddp_all_reduce": _ddp_all_reduce, "ddp_init_group": ddp_init_group, "get_rank": _get_rank}


def _route(session: Optional[Session] = None) -> None:
    """Every reference SpeechBrain holds to its helpers, its own module's and the copies other modules imported by
    name (the checkpointer, the loggers, ``core``), now distkit's (modules imported later import the new ones).
    Before a Session exists they call SpeechBrain's own."""
    for name, new in _ROUTED.items():
        old = _ORIGINAL[name]
        for module in [m for n, m in list(sys.modules.items()) if n.split(".")[0] == "speechbrain" and m is not None]:
            for attr, value in list(vars(module).items()):
                if value is old:
                    setattr(module, attr, new)


_route()  # ddp_init_group at once (the recipe's join point); the others answer as SpeechBrain's until then


def options_dict(run_opts: Any) -> dict[str, Any]:
    """A RunOptions (or dict, or None) as the dict SpeechBrain's Brain accepts; the options it set stay set."""
    if run_opts is None:
        return {}
    if isinstance(run_opts, dict):
        return dict(run_opts)
    explicit = getattr(run_opts, "overridden_args", set())
    return {k: v for k, v in run_opts.as_dict().items() if k in explicit}


def parse_arguments(arg_list: Optional[list[str]] = None) -> Any:
    """SpeechBrain's ``sb.parse_arguments`` without distkit's flags (taken at import from ``sys.argv``; from an
    explicit ``arg_list`` here too)."""
    if arg_list is not None:
        _, arg_list = _take_flags(list(arg_list))
    return _sb.parse_arguments(arg_list)

