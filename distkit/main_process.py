"""SpeechBrain-style helpers: ``run_on_main`` and ``is_main_process``.

They work inside a distkit run (any backend: they use the current Strategy's
collectives), in a script that initialised ``torch.distributed`` itself, and in a plain
single process (where they just run the function).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

from distkit.env import Collectives

#: the open Session's engine (set while one is open), for code below the Session: these helpers, the tasks
_CURRENT: Optional[Collectives] = None


def set_current_strategy(strategy: Optional[Collectives]) -> None:
    """Called by the Trainer when a run starts and ends."""
    global _CURRENT
    _CURRENT = strategy


def _torch_dist() -> Any:
    """torch.distributed if a process group exists; creates one (gloo) when the launcher says
    there are several ranks but nobody initialised it yet, as SpeechBrain's ``ddp_init_group``.
    A later Trainer.fit() with the DDP backend reuses that group."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    if not dist.is_initialized():
        from distkit.env import detect, resolve_rendezvous

        env = detect(os.environ)
        if env.world_size == 1:
            return None
        addr, port = resolve_rendezvous(env)
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=env.rank, world_size=env.world_size)
    return dist


def is_main_process() -> bool:
    """True on global rank 0 (or when not distributed)."""
    if _CURRENT is not None:
        return _CURRENT.is_main
    from distkit.env import detect

    return detect(os.environ).rank == 0


def run_on_main(func: Callable[..., Any], args: Optional[list[Any]] = None, kwargs: Optional[dict[str, Any]] = None,
                post_func: Optional[Callable[..., Any]] = None, post_args: Optional[list[Any]] = None,
                post_kwargs: Optional[dict[str, Any]] = None, run_post_on_main: bool = False) -> Any:
    """Collective: run ``func`` once, on rank 0, while the other ranks wait; return its result on every rank.

    Then ``post_func`` runs on the other ranks (and on rank 0 too if ``run_post_on_main``),
    e.g. to load what rank 0 prepared. SpeechBrain's semantics; the result is shared
    with every rank (it must be picklable). An exception on rank 0 propagates there and
    the launcher stops the others.
    """
    args, kwargs = args or [], kwargs or {}
    result = func(*args, **kwargs) if is_main_process() else None
    result = _broadcast(result)
    if post_func is not None:
        if run_post_on_main or not is_main_process():
            post_func(*(post_args or []), **(post_kwargs or {}))
        _barrier()  # every rank, so rank 0 does not run ahead of the others' post_func
    return result


def _broadcast(obj: Any) -> Any:
    if _CURRENT is not None:
        return _CURRENT.broadcast_object(obj, 0)
    dist = _torch_dist()
    if dist is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if _CURRENT is not None:
        _CURRENT.barrier()
    elif (dist := _torch_dist()) is not None:
        dist.barrier()
