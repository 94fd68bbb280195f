"""What a rank of a fault-tolerant replica group watches while it is inside a sync: the lighthouse (does it answer;
which groups does it count as gone) and its own clock (was this process stopped). Standard library only; the
threads that use it are :meth:`distkit.ft.groups.FaultTolerance._watching_lighthouse`'s."""
from __future__ import annotations

import http.client
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, Optional

from distkit.errors import ConfigError
from distkit.ft import gate

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


def lighthouse_answers(url: str, token: Optional[bytes] = None) -> Optional[str]:
    """None when the lighthouse at ``url`` answers, else why not (``token``: see :func:`lighthouse_status`)."""
    return lighthouse_status(url, token)[0]


class _GatedConnection(http.client.HTTPConnection):
    """An HTTP connection through the lighthouse's gate (the token proved both ways first)."""

    def __init__(self, host: str, port: int, token: bytes) -> None:
        super().__init__(host, port, timeout=PROBE_TIMEOUT_S)
        self._token = token

    def connect(self) -> None:
        self.sock = gate.open_gated(self.host, int(self.port), self._token, PROBE_TIMEOUT_S)
        self.sock.settimeout(PROBE_TIMEOUT_S)


def lighthouse_status(url: str, token: Optional[bytes] = None) -> tuple[Optional[str], str]:
    """(None, the lighthouse's /status page) when the lighthouse at ``url`` answers, else (why not, "").
    ``token``: the lighthouse's (its gate lets only its holders in, :mod:`distkit.ft.gate`); None: a lighthouse
    without a gate. A gate that refuses the token (or a server that is none) is why not, in its own words."""
    try:
        return _status(url, token)
    except gate.GateRefused as e:
        return str(e), ""


def _status(url: str, token: Optional[bytes]) -> tuple[Optional[str], str]:
    """:func:`lighthouse_status`, raising GateRefused."""
    try:
        if token is None:
            with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=PROBE_TIMEOUT_S) as answer:
                return None, answer.read().decode("utf-8", "replace")
        parsed = urllib.parse.urlparse(url)
        conn = _GatedConnection(parsed.hostname or "", parsed.port or 80, token)
        try:
            conn.request("GET", "/status")
            answer = conn.getresponse()
            return None, answer.read().decode("utf-8", "replace") if answer.status == 200 else ""
        finally:
            conn.close()
    except urllib.error.HTTPError:
        return None, ""  # something answered: the lighthouse (its pages may differ between versions)
    except gate.GateRefused:
        raise
    except http.client.BadStatusLine as e:
        if str(e).startswith(gate.GREETING.decode().strip()):
            raise gate.GateRefused(f"the lighthouse at {url} lets only holders of its token in: give the groups its "
                                   "token file (fault_tolerance.token_file), not None") from None
        return str(e) or type(e).__name__, ""
    except (OSError, ValueError, http.client.HTTPException) as e:
        return str(getattr(e, "reason", e)) or type(e).__name__, ""


def stale_heartbeats(status: str) -> dict[str, str]:
    """The replicas a lighthouse's /status page marks as gone (no heartbeat for longer than its heartbeat
    timeout), each with how long ago it was last seen as the page says it (``6.2s``)."""
    return {m.group(2): m.group(3) for m in _HEARTBEAT.finditer(status) if m.group(1)}


def probe_lighthouse(url: str, token_of: Callable[[], Optional[bytes]] = lambda: None) -> None:
    """Raise ConfigError, one line, when nothing answers at the lighthouse's address (before its token is looked
    for: starting the lighthouse makes the default one), when the token cannot be read (``token_of``'s own
    ConfigError), or when the lighthouse's gate and the token do not agree (which, and what to do)."""
    parsed = urllib.parse.urlparse(url)
    try:
        socket.create_connection((parsed.hostname or "", parsed.port or 80), timeout=PROBE_TIMEOUT_S).close()
        why = None
    except OSError as e:
        why = e.strerror or str(e) or type(e).__name__
    if why is None:
        try:
            why = _status(url, token_of())[0]
        except gate.GateRefused as e:
            raise ConfigError(f"fault_tolerance.lighthouse: {e}") from None
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
