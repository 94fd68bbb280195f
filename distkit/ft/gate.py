"""The lighthouse's gate: only holders of the lighthouse's token reach it (issue 59 item 4, issue 62 item 4).

torchft's lighthouse (gRPC for the groups' quorums and heartbeats, HTTP for its /status page and its
``POST /replica/<id>/kill``) authenticates no one, and its protocol has no place for a secret. So ``distkit
lighthouse`` runs it on a loopback port of its host and serves the address the groups are given with a *gate*
(:class:`Gate`): a TCP front that relays a connection to the lighthouse only after the peer proved it holds the
token. A group's ranks reach it through a *tunnel* (:class:`Tunnel`): a loopback port of their own process that
torchft's Manager is given as the lighthouse's address, whose connections are carried to the gate after the same
proof. The rank's own probes of the lighthouse (:func:`distkit.ft.watch.lighthouse_status`) open gated
connections directly (:func:`open_gated`).

The proof, on every connection before any byte of the lighthouse's protocol (both ways, so a stranger can stand
in neither for a group nor for the lighthouse)::

    gate -> peer   GREETING, nonce_g (32 random bytes)
    peer -> gate   nonce_p (32 random bytes), HMAC-SHA256(token, "peer" + nonce_g + nonce_p)
    gate -> peer   HMAC-SHA256(token, "gate" + nonce_g + nonce_p)

A peer without the proof is closed (one line on the lighthouse's stderr naming its address); a gate without it is
refused by the peer (one line naming the lighthouse's URL). What it is not: encryption. Someone who can watch the
network sees the lighthouse's traffic (not the token); see docs/security.md.

The token is 32 random bytes, hex in a file of mode 0600 (:func:`lighthouse_token`, made by ``distkit lighthouse``
when missing; ``~/.distkit/lighthouse.token`` unless ``--token-file``), which every rank of every group reads
(``fault_tolerance.token_file``, the same default: a cluster's shared home holds it once). The same token seals a
healing group's requests to the heal servers (:func:`heal_seal`). Standard library only: ``distkit lighthouse``
imports no torch.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import stat
import sys
import threading
from typing import Callable, Optional

from distkit.errors import ConfigError

#: where ``distkit lighthouse`` keeps its token and the groups look for it unless told otherwise
DEFAULT_TOKEN_FILE = "~/.distkit/lighthouse.token"
#: what the gate sends first (a peer that gets anything else is not talking to a gate)
GREETING = b"distkit-gate/1\n"
NONCE = 32
MAC = 32
#: seconds either side waits for the other's part of the proof
PROOF_TIMEOUT_S = 5.0
#: bytes relayed per read
CHUNK = 1 << 16


class GateRefused(ConnectionError):
    """The other side of a gated connection did not prove the token (or is not a gate at all): the message says
    which and what to do."""


def token_path(path: Optional[str]) -> str:
    """``path`` (None: the default) with ``~`` expanded."""
    return os.path.expanduser(path or DEFAULT_TOKEN_FILE)


def read_token(path: Optional[str]) -> bytes:
    """The token in ``path`` (the default file when None). ConfigError, one line: missing, unreadable, not 64 hex
    digits, or readable by others than its owner (a secret everyone can read is none)."""
    where = token_path(path)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ConfigError(f"the lighthouse token file {where} cannot be read ({e.strerror}): `distkit lighthouse` writes "
                          "it when it starts (--token-file); copy it to this host, or set fault_tolerance.token_file "
                          "to where it is") from None
    with os.fdopen(fd) as f:
        mode = os.fstat(f.fileno()).st_mode
        text = f.read(200).strip()
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"the lighthouse token file {where} is readable by others (mode {stat.S_IMODE(mode):o}): "
                          f"chmod 600 {where}")
    try:
        token = bytes.fromhex(text)
    except ValueError:
        token = b""
    if len(token) != 32:
        raise ConfigError(f"the lighthouse token file {where} does not hold a token (64 hex digits): delete it and "
                          "restart `distkit lighthouse`, which writes a new one (then restart the groups)")
    return token


def lighthouse_token(path: Optional[str]) -> tuple[bytes, bool]:
    """The token in ``path`` (the default when None), made first (mode 0600, in one atomic step: a lighthouse
    started beside it reads the same one) where there is none. Returns (token, whether it was made now)."""
    where = token_path(path)
    if not os.path.lexists(where):
        folder = os.path.dirname(where) or "."
        os.makedirs(folder, mode=0o700, exist_ok=True)
        temp = os.path.join(folder, f".{os.path.basename(where)}.{os.getpid()}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        try:
            os.link(temp, where)  # fails where another lighthouse made it meanwhile: that one is read below
            made = True
        except FileExistsError:
            made = False
        finally:
            os.unlink(temp)
        return read_token(where), made
    return read_token(where), False


def _mac(token: bytes, who: bytes, nonce_g: bytes, nonce_p: bytes) -> bytes:
    return hmac.new(token, who + nonce_g + nonce_p, hashlib.sha256).digest()


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            break
        data += part
    return data


def open_gated(host: str, port: int, token: bytes, timeout: float = PROOF_TIMEOUT_S) -> socket.socket:
    """A connection to the gate at ``host``:``port`` that proved the token both ways (blocking, no timeout once
    open). OSError where nothing answers; GateRefused where the other side is no gate or a gate of another token."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        try:
            hello = _read_exactly(sock, len(GREETING) + NONCE)
        except socket.timeout:
            hello = b""
        if not hello.startswith(GREETING) or len(hello) != len(GREETING) + NONCE:
            raise GateRefused(f"{host}:{port} is not a distkit lighthouse (it sent no gate greeting: torchft's own "
                              "lighthouse?): start it with `distkit lighthouse`, or set fault_tolerance.token_file = "
                              "None for one without authentication")
        nonce_g, nonce_p = hello[len(GREETING):], secrets.token_bytes(NONCE)
        sock.sendall(nonce_p + _mac(token, b"peer", nonce_g, nonce_p))
        try:
            proof = _read_exactly(sock, MAC)
        except (socket.timeout, ConnectionResetError):
            proof = b""
        if not proof:
            raise GateRefused(f"the lighthouse at {host}:{port} refused this group's token: give the groups the token "
                              "file that `distkit lighthouse` printed (fault_tolerance.token_file)")
        if not hmac.compare_digest(proof, _mac(token, b"gate", nonce_g, nonce_p)):
            raise GateRefused(f"the server at {host}:{port} did not prove the lighthouse's token: it is not the "
                              "lighthouse of this token file (another one, or a stranger on its address)")
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy both ways between ``a`` and ``b`` until both directions ended; then close both. Each direction's end
    (EOF) is passed on as a half-close, as the two ends of a plain connection would see it."""
    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(CHUNK)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    other = threading.Thread(target=pump, args=(b, a), name="distkit-gate-relay", daemon=True)
    other.start()
    pump(a, b)
    other.join()
    a.close()
    b.close()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def _serve(sock: socket.socket, handle: Callable[[socket.socket, tuple[str, int]], None], name: str) -> None:
    def loop() -> None:
        while True:
            try:
                conn, addr = sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=handle, args=(conn, addr), name=name, daemon=True).start()

    threading.Thread(target=loop, name=name, daemon=True).start()


class Gate:
    """The lighthouse's front (in ``distkit lighthouse``'s process): listens on ``bind``:``port`` from the start
    (OSError where it cannot) and, once :meth:`open` was called, relays each connection that proved ``token`` to
    the lighthouse on 127.0.0.1:``backend_port`` (a peer that came earlier waits in the listen queue). ``say``
    reports a refused peer (one line each)."""

    def __init__(self, bind: str, port: int, backend_port: int, token: bytes, say: Callable[[str], None]) -> None:
        self._token, self._backend, self._say = token, backend_port, say
        self.sock = _listen(bind, port)

    def open(self) -> None:
        """Start relaying (the lighthouse listens now)."""
        _serve(self.sock, self._handle, "distkit-gate")

    def _handle(self, conn: socket.socket, addr: tuple[str, int]) -> None:
        nonce_g = secrets.token_bytes(NONCE)
        try:
            conn.settimeout(PROOF_TIMEOUT_S)
            conn.sendall(GREETING + nonce_g)
            answer = _read_exactly(conn, NONCE + MAC)
            nonce_p, mac = answer[:NONCE], answer[NONCE:]
            if not answer:  # closed without a word: a check that the port is open (a test's, a load balancer's)
                conn.close()
                return
            if len(answer) != NONCE + MAC or not hmac.compare_digest(mac, _mac(self._token, b"peer", nonce_g, nonce_p)):
                self._say(f"refused a connection from {addr[0]} port {addr[1]}: it did not prove the lighthouse's "
                          "token (a stranger, or a group given another token file)")
                conn.close()
                return
            conn.sendall(_mac(self._token, b"gate", nonce_g, nonce_p))
            conn.settimeout(None)
            backend = socket.create_connection(("127.0.0.1", self._backend), timeout=PROOF_TIMEOUT_S)
            backend.settimeout(None)
        except OSError:
            conn.close()
            return
        _relay(conn, backend)

    def close(self) -> None:
        self.sock.close()


class Tunnel:
    """A loopback port of this process (:attr:`url`) whose every connection is carried to the gate at ``host``:
    ``port`` after the token was proved both ways: the lighthouse's address for torchft's Manager, whose client
    cannot prove anything itself. A connection whose proof fails (or that reaches nothing) is closed: the rank's
    own probes, which open gated connections directly (:func:`distkit.ft.watch.lighthouse_status`), say why."""

    def __init__(self, host: str, port: int, token: bytes) -> None:
        self._host, self._port, self._token = host, port, token
        self.sock = _listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        _serve(self.sock, self._handle, "distkit-lighthouse-tunnel")

    def _handle(self, conn: socket.socket, _addr: tuple[str, int]) -> None:
        try:
            remote = open_gated(self._host, self._port, self._token)
        except OSError:  # (GateRefused too)
            conn.close()
            return
        _relay(conn, remote)

    def close(self) -> None:
        self.sock.close()


def heal_seal(token: bytes, path: str) -> str:
    """What a healing group's request for ``path`` on a heal server carries (header :data:`HEAL_HEADER`): hex
    HMAC-SHA256 under the lighthouse's token."""
    return hmac.new(token, b"heal\n" + path.encode(), hashlib.sha256).hexdigest()


#: the header of a sealed heal request
HEAL_HEADER = "X-Distkit-Seal"


def say_stderr(line: str) -> None:
    """One distkit line on stderr (the gate's reports)."""
    print(f"distkit lighthouse: {line}", file=sys.stderr, flush=True)
