"""The heartbeat store's records, sealed with the job's token, and the mark by which a rank's process is known on its
host (issue 59 item 4, issue 62 item 4).

The heartbeat store is torch's ``TCPStore``: whoever reaches its port can read, write and delete any key, and torch
has no way to refuse a peer. distkit cannot keep a stranger out of it; it makes what a stranger writes worthless:

* **the job's token**: 32 random bytes (:func:`new_token`) that rank 0 makes when it serves the store and sends to
  the other ranks with the store's address, through the engine's own broadcast (the channel that already carries the
  rendezvous; :func:`distkit.health.store.connect_store`). It is never in the environment (every child process would
  inherit it), a file or the store.
* **sealed values**: every value distkit writes is ``<payload> #<HMAC-SHA256(token, key, payload), 32 hex>``
  (:meth:`Seal.seal`); a reader opens it strictly (ASCII, at most :data:`MAX_VALUE` bytes, the seal, then the
  payload's own grammar: :func:`parse_who`, :func:`parse_count`) and takes nothing from a value that fails. The MAC
  covers the key, so a rank's record copied to another rank's key fails too.
* **a pid is never taken from the store alone**: before it publishes ``who/<rank>`` a rank names one of its own
  threads with :func:`mark` (``dk`` and 13 hex digits of HMAC(token, rank, pid)); a pid read from the store is
  signalled only if that process carries the mark (:func:`marked_start`; Linux lets a process name only its own
  threads, so a pid whose process did not name itself this way, a stranger's victim, never carries it) and still
  has the start time it had then (a recycled pid does not).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import threading
from typing import Optional

from distkit.launch.procfs import stat_fields

#: the longest value a reader looks at (bytes): a record is a host identity, a pid and a seal, well under it
MAX_VALUE = 1024
#: hex digits of the MAC in a sealed value (128 bits)
MAC_HEX = 32
#: the largest pid Linux hands out (``PID_MAX_LIMIT`` on 64-bit)
PID_MAX = 4 * 1024 * 1024

_HOST = re.compile(r"[!-~]{1,512}")  # a host identity: printable ASCII, no space (distkit.launch.netif.host_identity)
_PID = re.compile(r"[1-9][0-9]{0,6}")
_COUNT = re.compile(r"0|[1-9][0-9]{0,17}")


def new_token() -> bytes:
    """A fresh job token: 32 bytes from the operating system's random source."""
    return secrets.token_bytes(32)


#: a token for watchdogs made without one (several ranks' watchdogs in one process, as the tests make them): the
#: same for every watchdog of this process, so they accept each other's records
_PROCESS_TOKEN: Optional[bytes] = None
_LOCK = threading.Lock()


def process_token() -> bytes:
    """This process's own token (made once): for watchdogs made without the job's."""
    global _PROCESS_TOKEN
    with _LOCK:
        if _PROCESS_TOKEN is None:
            _PROCESS_TOKEN = new_token()
        return _PROCESS_TOKEN


class Seal:
    """Seals and opens the values of one job's heartbeat store with its token. Not collective."""

    def __init__(self, token: bytes) -> None:
        if len(token) < 16:
            raise ValueError("a job token has at least 16 bytes")
        self._token = token

    def _mac(self, key: str, payload: str) -> str:
        return hmac.new(self._token, f"{key}\n{payload}".encode(), hashlib.sha256).hexdigest()[:MAC_HEX]

    def seal(self, key: str, payload: str) -> str:
        """The value to store under ``key`` for ``payload`` (ASCII, no newline)."""
        return f"{payload} #{self._mac(key, payload)}"

    def open(self, key: str, raw: object) -> tuple[Optional[str], str]:
        """``(payload, "")`` of a value this job sealed under ``key``; ``(None, why)`` for anything else: not
        bytes, too long, not ASCII, no seal, a seal that does not match (another key's record, another job's, a
        stranger's)."""
        if not isinstance(raw, (bytes, bytearray)):
            return None, f"a {type(raw).__name__}, not bytes"
        if len(raw) > MAX_VALUE:
            return None, f"{len(raw)} bytes, more than a record's {MAX_VALUE}"
        try:
            text = bytes(raw).decode("ascii")
        except UnicodeDecodeError:
            return None, "not ASCII"
        payload, sep, mac = text.rpartition(" #")
        if not sep or len(mac) != MAC_HEX or "\n" in payload:
            return None, "not sealed"
        if not hmac.compare_digest(mac, self._mac(key, payload)):
            return None, "its seal does not match: not written by this job"
        return payload, ""


def parse_who(payload: str) -> Optional[tuple[str, int]]:
    """``(host identity, pid)`` of a ``who/<rank>`` payload ``"<host identity> <pid>"``; None if it is not one."""
    host, sep, pid = payload.rpartition(" ")
    if not sep or not _HOST.fullmatch(host) or not _PID.fullmatch(pid) or int(pid) > PID_MAX:
        return None
    return host, int(pid)


def parse_count(payload: str) -> Optional[int]:
    """The heartbeat counter of a ``hb/<rank>`` payload (a decimal number, no sign or leading zero); None else."""
    return int(payload) if _COUNT.fullmatch(payload) else None


def mark(token: bytes, rank: int, pid: int) -> str:
    """The thread name by which process ``pid`` shows itself to be rank ``rank`` of the job of ``token``: 15
    characters (Linux's limit), ``dk`` and 13 hex digits of HMAC-SHA256(token, rank, pid)."""
    return "dk" + hmac.new(token, f"mark\n{rank}\n{pid}".encode(), hashlib.sha256).hexdigest()[:13]


def name_thread(thread: threading.Thread, name: str) -> bool:
    """Give ``thread`` (a started thread of this process) the kernel name ``name`` (its ``comm``, what
    :func:`marked_start` reads). Returns whether it was named (no /proc: not, and no peer will signal this rank)."""
    tid = thread.native_id
    if tid is None:
        return False
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(name)
    except OSError:
        return False
    return True


def marked_start(pid: int, name: str) -> Optional[str]:
    """Process ``pid``'s start time (``/proc/PID/stat``'s field, which tells a recycled pid apart) if one of its
    threads is named ``name``; None if none is, or the process is gone (or /proc cannot be read)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().rstrip("\n") != name:
                    continue
        except OSError:
            continue
        fields = stat_fields(pid)
        return fields[19] if fields is not None and len(fields) > 19 else None
    return None
