"""torchft, adapted for :mod:`distkit.ft.groups`: its Manager's log lines as one distkit line each, the
quorums it drops kept, its heal transport reading weights only, listening on one address and serving sealed
requests only, its heal server's access lines silenced, its reconfigurable gloo group with a connect bound apart from the exchange bound (and kept
alive when an exchange is given up), distkit's group numbers from torchft's replica ids."""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import hmac
import logging
import pickle
import re
import socket
import socketserver
import sys
import threading
import urllib.parse
import urllib.request
from typing import Any, Callable, Iterator, Optional

import torch

from distkit.errors import DistkitError
from distkit.ft import gate


class TorchftLines(logging.Filter):
    """torchft's Manager logs each failure it handles (a sync's exchange or quorum failed: the sync is not
    committed, which distkit's sync line reports) with its traceback, labelled with torchft's own count of syncs
    (``[distkit_group_1:<uuid>/1 - step 0] got exception in pg configure: ...``). Here such a record becomes one
    line, labelled with the group, the rank and the training step (issue 36 item 12); the "flight recorder"
    warning that every new quorum logs without NCCL is dropped."""

    def __init__(self, replica_id: int, rank: int, step_of: Callable[[], int]) -> None:
        """``step_of()``: the training step whose sync is under way (read when a record comes)."""
        super().__init__()
        self._replica_id, self._rank, self._step_of = replica_id, rank, step_of

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "flight recorder" in text:
            return False
        if record.exc_info or record.levelno >= logging.ERROR:
            lines = re.sub(r"^\[[^\]]*\]\s*", "", text).splitlines()  # without torchft's label
            text = lines[0] if lines else "an error"
            record.msg, record.args = (f"distkit: group {self._replica_id} rank {self._rank}, sync at step "
                                       f"{self._step_of()}: torchft: {text[:300]}"), ()
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


class QuorumsSeen:
    """torchft's ``ManagerClient``, passed through, keeping the last quorum's answer (``last``: its members'
    replica ids in rank order, this rank's heal source), which the Manager uses and drops."""

    def __init__(self, client: Any) -> None:
        self._client, self.last = client, None
        #: how many quorums the lighthouse answered so far (``last`` is then set)
        self.count = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._client._quorum(*args, **kwargs)
        self.count += 1
        return self.last


#: torchft's HTTP transport builds its server while this lock is held (the server class is swapped for the build)
_BUILDING = threading.Lock()


def heal_transport(timeout: datetime.timedelta, bind: str, token: Optional[bytes] = None) -> Any:
    """torchft's HTTP checkpoint transport (how a healing group receives a live group's state), with three changes:

    * what a peer sends is read by torch's weights-only unpickler (tensors, numbers, strings, containers), not
      torchft's ``weights_only=False``: a live group's state is plain data (:func:`distkit.ft.state.training_state`),
      and a server that sends anything else (a pickled object's ``__reduce__``) is refused with one line, before
      any of it runs;
    * its server listens on ``bind`` (the address the other groups are told, as the group's store; "" keeps
      torchft's every interface) and names that address, not the host's name, to the groups that heal from it;
    * with ``token`` (the lighthouse's, :mod:`distkit.ft.gate`) every request carries its seal (an HMAC of the
      path under the token, header :data:`~distkit.ft.gate.HEAL_HEADER`) and the server serves only sealed ones:
      a stranger who reaches the server gets 403 and no state (one line on the serving rank's stderr).

    The traffic is not encrypted (someone who watches the network sees the state served)."""
    from torchft.checkpointing import http_transport
    from torchft.checkpointing._serialization import _streaming_load
    from torchft.http import _IPv6HTTPServer

    family = socket.AF_INET6 if ":" in bind or not bind else socket.AF_INET

    class Server(_IPv6HTTPServer):  # type: ignore[misc, valid-type]
        address_family = family

        def server_bind(self) -> None:  # (http.server's looks the address's name up in DNS: seconds where none answers)
            socketserver.TCPServer.server_bind(self)
            self.server_name, self.server_port = self.server_address[:2]

    def sealed(handler: type) -> type:
        if token is None:
            return handler

        class Sealed(handler):  # type: ignore[misc, valid-type]
            def do_GET(self) -> None:
                seal = self.headers.get(gate.HEAL_HEADER, "")
                if not hmac.compare_digest(seal.encode(), gate.heal_seal(token, self.path).encode()):
                    self.send_error(403, "not sealed with the lighthouse's token")  # (logged by quiet_heal_server)
                    return
                super().do_GET()

        return Sealed

    class WeightsOnlyHTTPTransport(http_transport.HTTPTransport):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            with _BUILDING:  # torchft builds its server on ("", 0): on bind here instead, sealed where there is a token
                original = http_transport._IPv6HTTPServer
                http_transport._IPv6HTTPServer = lambda _address, handler: Server((bind, 0), sealed(handler))
                try:
                    super().__init__(timeout=timeout, num_chunks=0)
                finally:
                    http_transport._IPv6HTTPServer = original

        def address(self) -> str:
            if not bind:
                return str(super().address())
            host = f"[{bind}]" if ":" in bind else bind
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

        @classmethod
        def _load_from_address(cls, address: str, timeout: datetime.timedelta) -> object:
            request = urllib.request.Request(address)
            if token is not None:
                request.add_header(gate.HEAL_HEADER, gate.heal_seal(token, urllib.parse.urlparse(address).path))
            with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as f:
                try:
                    return _streaming_load(f, weights_only=True)
                except pickle.UnpicklingError as e:
                    text = str(e)
                    found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"Unsupported global: ([\w.]+)", text)
                    what = found.group(1) if found else (text.splitlines() or [type(e).__name__])[0][:200]
                    raise DistkitError(f"refused the state a live group sent from {address}: loading it would run "
                                       f"code (it names {what}); a heal takes tensors, numbers, strings and "
                                       "containers only (docs/security.md)") from None

    return WeightsOnlyHTTPTransport()


@contextlib.contextmanager
def manager_server_on(bind: str) -> Iterator[None]:
    """While torchft's Manager is built: its server (on the group's rank 0: what the group's other ranks and a healing
    group call), which torchft starts on ``[::]:PORT`` (every interface), listens on ``bind`` instead (the address
    it is known by: the Manager's ``hostname``). "" changes nothing."""
    import torchft.manager as torchft_manager

    if not bind:
        yield
        return
    original = torchft_manager.ManagerServer
    host = f"[{bind}]" if ":" in bind else bind

    def narrow(**kwargs: Any) -> Any:
        return original(**{**kwargs, "bind": f"{host}:{str(kwargs['bind']).rpartition(':')[2]}"})

    torchft_manager.ManagerServer = narrow
    try:
        yield
    finally:
        torchft_manager.ManagerServer = original


def quiet_heal_server(manager: Any, who: str) -> None:
    """torchft's HTTP checkpoint server (what a live group serves a healing one from) is Python's http.server,
    which writes an access line per request to stderr (``::ffff:127.0.0.1 - - [...] "GET /checkpoint/6/full
    HTTP/1.1" 200 -``): a served heal is already named by the sync lines of both sides, so those go; anything else
    it reports (a refused or failed request) becomes one distkit line naming ``who``."""
    server = getattr(getattr(manager, "_checkpoint_transport", None), "_server", None)
    handler = getattr(server, "RequestHandlerClass", None)
    if handler is None:  # another transport, or a torchft that keeps it elsewhere: its lines stay as they are
        return

    def log_message(self: Any, format: str, *args: Any) -> None:
        if format.startswith('"%s" %s') and len(args) >= 2 and str(args[1]).startswith("2"):
            return  # the access line of a served request
        print(f"distkit: {who}, heal server: {format % args}", file=sys.stderr, flush=True)

    handler.log_message = log_message


def groups_of(replica_ids: list[str]) -> list[int]:
    """distkit's group numbers of torchft replica ids (``distkit_group_<N>:<uuid of this start>``), in order."""
    return [int(r.split(":")[0].rsplit("_", 1)[1]) for r in replica_ids]


def quorum_gloo(base: type, timeout: datetime.timedelta, connect: datetime.timedelta) -> Any:
    """torchft's reconfigurable gloo group (``base``: :class:`torchft.process_group.ProcessGroupGloo`) whose
    rendezvous at a new quorum is bounded by ``connect``, its exchanges by ``timeout``.

    Why: a group that dies after it asked the lighthouse for a quorum is still in the quorum the others receive
    (its heartbeat has not timed out yet). When that quorum is new, every member rebuilds the gloo group and
    waits for the dead one to connect: with one timeout for both, ``distributed.timeout_s`` (300 s by default)
    per such death, the survivors standing still. Connecting takes the members well under a second (all of them
    start it the moment the lighthouse answers, from torchft's quorum thread), so ``connect`` can be short; an
    exchange of a large model over a slow link cannot."""

    class QuorumGloo(base):  # type: ignore[misc, valid-type]
        def configure(self, *args: Any, **kwargs: Any) -> None:
            # torchft connects to the quorum's store and creates the gloo backend (whose constructor is the
            # rendezvous) with self._timeout: the connect bound for those, the exchange bound from then on
            self._timeout = connect
            try:
                super().configure(*args, **kwargs)
            finally:
                self._timeout = timeout
            self._pg._get_backend(torch.device("cpu"))._set_default_timeout(timeout)

        def keep_alive(self) -> None:
            """Never free the current gloo group: an exchange given up is still pending in it (gloo cannot cancel
            it), and freeing the group (torchft drops it at the next quorum's configure; Python at a script's
            exit) waits for that exchange to end, up to ``distributed.timeout_s``, with the GIL held. A group is
            given up only when another froze inside a sync: what is kept (its threads, its sockets) is small."""
            if self._pg is not None:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._pg))

    return QuorumGloo(timeout=timeout)
