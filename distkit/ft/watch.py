"""What a rank of a fault-tolerant replica group watches while it is inside a sync: the lighthouse (does it answer;
which groups does it count as gone) and its own clock (was this process stopped). Standard library only; the
threads that use it are :meth:`distkit.ft.groups.FaultTolerance._watching_lighthouse`'s."""
from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from typing import Optional

from distkit.errors import ConfigError

#: seconds a rank waits for the lighthouse to answer at start before it says it is unreachable
PROBE_TIMEOUT_S = 5.0
#: seconds between probes of the lighthouse while a rank waits for a quorum
WATCH_INTERVAL_S = 2.0
#: seconds between two looks, while a rank is inside a sync, at the clock (and at whether its exchange completed):
#: a look that comes :data:`FROZEN_S` late means this process was stopped (or not run) meanwhile
TICK_S = 0.25
#: seconds a rank may have been stopped inside a sync (SIGSTOP, a debugger, a starved machine) before it gives that
#: sync up. Below the lighthouse's heartbeat timeout (5 s by default, ``distkit lighthouse --heartbeat-timeout``),
#: after which the other groups may have found it gone and given the exchange up themselves: were it to complete
#: the exchange with what they left behind and commit, it would hold a model they do not
FROZEN_S = 2.0
#: a heartbeat on the lighthouse's /status page: the replica, how long ago it was seen, and the ``old`` class that
#: marks one the lighthouse counts as gone (older than its heartbeat timeout)
_HEARTBEAT = re.compile(r'<li class="heartbeat\s*(old)?\s*">\s*([^\s<]+): seen ([^\s<]+) ago')


def lighthouse_answers(url: str) -> Optional[str]:
    """None when the lighthouse at ``url`` answers, else why not."""
    return lighthouse_status(url)[0]


def lighthouse_status(url: str) -> tuple[Optional[str], str]:
    """(None, the lighthouse's /status page) when the lighthouse at ``url`` answers, else (why not, "")."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=PROBE_TIMEOUT_S) as answer:
            return None, answer.read().decode("utf-8", "replace")
    except urllib.error.HTTPError:
        return None, ""  # something answered: the lighthouse (its pages may differ between versions)
    except (OSError, ValueError) as e:
        return str(getattr(e, "reason", e)), ""


def stale_heartbeats(status: str) -> dict[str, str]:
    """The replicas a lighthouse's /status page marks as gone (no heartbeat for longer than its heartbeat
    timeout), each with how long ago it was last seen as the page says it (``6.2s``)."""
    return {m.group(2): m.group(3) for m in _HEARTBEAT.finditer(status) if m.group(1)}


def probe_lighthouse(url: str) -> None:
    """Raise ConfigError when nothing answers at the lighthouse's address."""
    why = lighthouse_answers(url)
    if why is not None:
        raise ConfigError(f"fault_tolerance.lighthouse {url} does not answer ({why}): start it first "
                          "(`distkit lighthouse --port PORT`), or give its address")


class Watch:
    """What the threads of :meth:`distkit.ft.groups.FaultTolerance._watching_lighthouse` found while this rank is inside a sync."""

    def __init__(self) -> None:
        #: why the exchange is to be given up (a group of the quorum stopped heartbeating), else None
        self.lost: Optional[str] = None
        #: time.monotonic() and time.process_time() at the clock thread's last look (seconds)
        self.last, self.last_cpu = time.monotonic(), time.process_time()
        #: the longest this process was stopped between two looks (seconds)
        self.stopped = 0.0

    def off(self, now: float, cpu: float) -> float:
        """Seconds this process was stopped since the last look, as seen at ``now`` (monotonic) with ``cpu``
        seconds of CPU used by all its threads: how late the look is, less the CPU its threads used meanwhile.
        A stopped process uses none; one whose clock thread only waited for the GIL (a long pickling, say) used
        about as much as the wait took, and is not counted as stopped (its heartbeat, sent by torchft's threads
        outside the GIL, went on)."""
        return (now - self.last - TICK_S) - (cpu - self.last_cpu)

    def stopped_s(self) -> float:
        """The longest time (seconds) this process was stopped since the sync began, as far as is known now: the
        clock thread's findings, or the stop it has not yet looked at (woken, it may not have run yet). ``last``
        is read before ``last_cpu`` (in :meth:`off`): the clock thread writes it last."""
        return max(self.stopped, self.off(time.monotonic(), time.process_time()))


#: a duration as the lighthouse's /status page prints it (Rust's ``Duration`` debug form): ``5.99370436s``, ``350.2ms``
_DURATION = re.compile(r"^([0-9.]+)(s|ms|µs|us|ns)$")
_UNIT_S = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}


def groups_named_ago(gone: list[tuple[int, str]]) -> str:
    """``group 2 (last heard from 6.0 s ago)``, several joined by commas (a duration the page wrote in another
    form is kept as it was)."""
    def ago(text: str) -> str:
        m = _DURATION.match(text)
        return f"{float(m.group(1)) * _UNIT_S[m.group(2)]:.1f} s" if m else text

    return ", ".join(f"group {g} (last heard from {ago(text)} ago)" for g, text in gone)
