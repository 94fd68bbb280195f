"""``distkit lighthouse``: start torchft's lighthouse (the one ``torchft_lighthouse`` runs, in the torchft
wheel), which forms the quorum of fault-tolerant replica groups at every sync (:mod:`distkit.ft.groups`),
and say where the groups find it. It runs in the foreground until it is stopped (Ctrl-C, SIGTERM); its exit
status is the lighthouse's. The lighthouse itself listens on loopback; the address the groups are given is
its gate (:mod:`distkit.ft.gate`), which lets only peers that prove the token in. Neither this command nor the
lighthouse imports torch (:mod:`distkit.ft.lighthouse`): it listens about 0.2 s after the command starts, not
3 s."""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from distkit.ft import gate
from distkit.ft import lighthouse as ft_lighthouse
from distkit.errors import BackendUnavailable, ConfigError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("lighthouse", help="start torchft's lighthouse for fault-tolerant replica groups",
                       allow_abbrev=False,
                       description="Start torchft's lighthouse (the quorum of fault-tolerant replica groups) in the "
                                   "foreground and print the URL for fault_tolerance.lighthouse.")
    p.add_argument("--port", type=int, default=29510, help="port to listen on (default 29510; 0: any free port is "
                                                             "not supported by the lighthouse, give one)")
    p.add_argument("--bind", default="127.0.0.1", metavar="ADDRESS",
                   help="the address to listen on (default 127.0.0.1: groups on this host only; on a cluster the "
                        "address of the interface the groups reach it by, e.g. the login node's; :: or 0.0.0.0 for "
                        "every interface). Only peers that prove the token reach the lighthouse (docs/security.md)")
    p.add_argument("--token-file", dest="token_file", default=None, metavar="PATH",
                   help=f"the token the groups must prove (default {gate.DEFAULT_TOKEN_FILE}); written, mode 0600, "
                        "when missing. Give the groups the same file: fault_tolerance.token_file (the default file "
                        "needs nothing on hosts that share the home directory)")
    p.add_argument("--min-replicas", dest="min_replicas", type=int, default=1, metavar="N",
                   help="groups a quorum needs at least (default 1: the groups go on as long as one lives)")
    p.add_argument("--join-timeout", dest="join_timeout", type=float, default=10.0, metavar="S",
                   help="seconds a quorum waits for groups that are alive but late (default 10)")
    p.add_argument("--heartbeat-timeout", dest="heartbeat_timeout", type=float, default=5.0, metavar="S",
                   help="seconds without a group's heartbeat after which it is left out (default 5)")
    p.add_argument("--quiet", action="store_true",
                   help="log warnings and errors only (the lighthouse logs every quorum request: about 1 KB per "
                        "group per sync)")


def command(args: argparse.Namespace, backend_port: int) -> list[str]:
    """The lighthouse's command line for ``args``, listening on 127.0.0.1:``backend_port`` (behind the gate)
    (ConfigError for bad values; BackendUnavailable without torchft)."""
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port must be 1 .. 65535, got {args.port}")
    if args.min_replicas < 1:
        raise ConfigError(f"--min-replicas must be >= 1, got {args.min_replicas}")
    for name in ("join_timeout", "heartbeat_timeout"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {getattr(args, name)}")
    if ft_lighthouse.extension_path() is None:
        raise BackendUnavailable(f"torchft is not installed: {ft_lighthouse.INSTALL_HINT}")
    return [sys.executable, ft_lighthouse.__file__, "--bind", f"127.0.0.1:{backend_port}", "--min_replicas", str(args.min_replicas),
            "--join_timeout_ms", str(int(args.join_timeout * 1000)),
            "--heartbeat_timeout_ms", str(int(args.heartbeat_timeout * 1000)), "--quorum_tick_ms", "100"]


def _free_loopback_port() -> int:
    """A port free on 127.0.0.1 now (the lighthouse takes no port 0; it binds this one a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(proc: "subprocess.Popen[bytes]", port: int) -> bool:
    """Until the lighthouse accepts on 127.0.0.1:``port`` (True) or has ended (False). Polls every 20 ms: it
    listens about 0.2 s after it starts."""
    while proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            time.sleep(0.02)
    return False


def run(args: argparse.Namespace) -> int:
    backend_port = _free_loopback_port()
    cmd = command(args, backend_port)
    try:
        token, made = gate.lighthouse_token(args.token_file)
    except OSError as e:
        raise ConfigError(f"--token-file {gate.token_path(args.token_file)}: cannot write it ({e.strerror})") from None
    try:  # bound first: a taken port is one line before anything starts
        front = gate.Gate(args.bind, args.port, backend_port, token, gate.say_stderr)
    except OSError as e:
        raise ConfigError(f"cannot listen on {args.bind} port {args.port} ({e.strerror}): give another --port or "
                          "--bind") from None
    # the URL the groups can use: the bound address itself, or this host's name where it listens everywhere
    host = socket.gethostname() if args.bind in ("0.0.0.0", "::", "") else (
        f"[{args.bind}]" if ":" in args.bind else args.bind)
    where = gate.token_path(args.token_file)
    file_key = "" if args.token_file is None else f", 'token_file': '{where}'"
    print(f"distkit: lighthouse at http://{host}:{args.port} (min_replicas {args.min_replicas}): "
          f"give the groups fault_tolerance = {{'lighthouse': 'http://{host}:{args.port}'{file_key}, ...}}; "
          f"token {'written to' if made else 'from'} {where} (every group's host needs it)",
          flush=True)
    # The lighthouse writes its log to this command's stderr. It blocks once that is a full pipe nobody reads,
    # and then forms no quorum: the groups would wait. --quiet keeps the log to warnings (torchft's Rust logger
    # reads RUST_LOG); the docs say to send it to a file.
    env = {**os.environ, "RUST_LOG": "warn"} if args.quiet else None
    proc = subprocess.Popen(cmd, env=env)

    def stop(signum: int, _frame: Any) -> None:
        proc.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    try:
        # the gate relays once the lighthouse listens: a group that reaches the address reaches the lighthouse
        if _wait_listening(proc, backend_port):
            front.open()
        return proc.wait()
    finally:
        front.close()
