"""A user's script's flags and config sources for :func:`distkit.init`: :func:`add_arguments` adds distkit's
flags (and ``++key value``) to the script's own ``argparse`` parser; :func:`config_from` turns any accepted
source (a namespace, a dict, config files, a RunConfig) into one validated RunConfig. Pure data, as the
rest of ``distkit.config``."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence, Union

from distkit.config import LaunchFlags, RunConfig, load_config, resolve, split_overrides
from distkit.errors import UsageError

Source = Union[argparse.Namespace, dict, RunConfig, str, Sequence[str], None]

#: ``dest`` of the ``++key value`` pairs and ``--config`` files on a namespace from :func:`add_arguments`
OVERRIDES_DEST, CONFIGS_DEST = "distkit_overrides", "distkit_configs"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add distkit's command-line flags to a user's ``parser`` (and return it).

    ``--config FILE...`` (config files, later wins), ``++key value`` (any config key; parsed
    by ``parse_args`` too), ``--nprocs N``, ``--deepspeed``, ``--deepspeed_config JSON``,
    ``--local_rank/--local-rank N`` (DeepSpeed's launcher, torch.distributed.launch),
    ``--distributed_backend gloo|nccl`` (SpeechBrain). A flag the parser already has (e.g.
    from ``deepspeed.add_config_arguments`` or the LUMI script's own ``--local-rank``) is kept
    as the user defined it and read from the namespace under its usual name.
    """
    group = parser.add_argument_group("distkit")

    def add(*flags: str, **kwargs: Any) -> None:
        if not any(f in parser._option_string_actions for f in flags):  # the user's own flag wins
            group.add_argument(*flags, **kwargs)

    add("--config", dest=CONFIGS_DEST, nargs="+", action="extend", default=[], metavar="FILE",
        help="distkit config files (.py, .yaml, .json); ++key value overrides them")
    add("--nprocs", type=int, default=None, metavar="N", help="start N local ranks (ignored under a launcher)")
    add("--deepspeed", action="store_true", help="use the DeepSpeed engine")
    add("--deepspeed_config", default=None, metavar="JSON", help="DeepSpeed config file (implies --deepspeed)")
    add("--local_rank", "--local-rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS)
    add("--distributed_backend", choices=["gloo", "nccl"], default=None,
        help="torch.distributed backend (SpeechBrain's flag)")
    original = parser.parse_known_args

    def parse_known_args(args: Optional[Sequence[str]] = None, namespace: Any = None) -> Any:
        rest, pairs = split_overrides(list(sys.argv[1:] if args is None else args))
        ns, extra = original(rest, namespace)
        setattr(ns, OVERRIDES_DEST, getattr(ns, OVERRIDES_DEST, []) + pairs)
        return ns, extra

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]  # ++key value next to argparse's own
    return parser


def _from_namespace(args: argparse.Namespace, keys: dict[str, Any]) -> tuple[RunConfig, Optional[int]]:
    local_rank = getattr(args, "local_rank", None)
    local_rank = None if local_rank is None or local_rank < 0 else int(local_rank)  # LUMI's default is -1
    flags = LaunchFlags(local_rank=local_rank, distributed_backend=getattr(args, "distributed_backend", None),
                        deepspeed=bool(getattr(args, "deepspeed", False)),
                        deepspeed_config=getattr(args, "deepspeed_config", None), nprocs=getattr(args, "nprocs", None))
    overrides = list(getattr(args, OVERRIDES_DEST, [])) + list(keys.items())
    return load_config(list(getattr(args, CONFIGS_DEST, []) or []), overrides, flags), local_rank


def config_from(source: Source, **keys: Any) -> tuple[RunConfig, Optional[int]]:
    """One validated RunConfig from any accepted source (see :func:`init`), and a ``--local_rank`` if given."""
    if isinstance(source, argparse.Namespace):
        return _from_namespace(source, keys)
    if isinstance(source, RunConfig):
        if keys:
            raise UsageError("distkit.init(RunConfig, **keys): put the keys into the RunConfig, or pass a dict")
        return source, None
    if isinstance(source, str):
        return load_config([source], list(keys.items())), None
    if isinstance(source, (list, tuple)):
        return load_config([str(p) for p in source], list(keys.items())), None
    if source is None or isinstance(source, dict):
        return resolve({**(source or {}), **keys}), None
    raise UsageError(f"distkit.init() takes an argparse.Namespace, a dict, a config file path or a RunConfig, "
                     f"got {type(source).__name__}")
