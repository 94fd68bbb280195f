"""Fault injection for failure tests: real SIGKILLs and exceptions at a chosen step.

``DISTKIT_FAULT="RANK:STEP:KIND"`` makes rank RANK, right after optimizer step STEP,
``kill`` itself with SIGKILL, ``raise`` RuntimeError, or ``hang`` (sleep forever, to test
timeouts). Read once at import; unset in normal runs, where it costs one comparison.
"""
from __future__ import annotations

import os
import signal
import time

_SPEC = os.environ.get("DISTKIT_FAULT", "")
_RANK, _STEP, _KIND = (int(_SPEC.split(":")[0]), int(_SPEC.split(":")[1]), _SPEC.split(":")[2]) if _SPEC else (-1, -1, "")


def maybe_fire(rank: int, step: int) -> None:
    """Fire the configured fault if this is its rank and step."""
    if rank != _RANK or step != _STEP:
        return
    if _KIND == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif _KIND == "raise":
        raise RuntimeError(f"injected fault at step {step} (DISTKIT_FAULT={_SPEC})")
    elif _KIND == "hang":
        while True:
            time.sleep(3600)
