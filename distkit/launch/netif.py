"""Which network interface the ranks of a multi-host job talk over, chosen from the rendezvous address.

gloo picks its interface by resolving the host name; where the host name resolves to a loopback
address (Debian's ``127.0.1.1``, containers and network namespaces sharing one name) it then
advertises ``127.0.0.1`` to the other hosts, which dial themselves and fail with "connection
refused". The interface the kernel routes to the rendezvous address (``MASTER_ADDR``) is the one
the other hosts can reach, so distkit sets ``GLOO_SOCKET_IFNAME`` to it before the process group is
created, unless the user set it. A wrong ``GLOO_SOCKET_IFNAME`` (no such interface here) is a
ConfigError naming the variable and the interfaces this host has, instead of gloo's abort.

Open MPI picks its own interfaces (every non-loopback one); across hosts with several, give
``mpirun --mca btl_tcp_if_include <CIDR or name>`` (see docs/multinode.md). Where that is missing
and a start-up collective hangs, the mpi engine's timeout message says so.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import functools
import ipaddress
import os
import socket
import struct
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, Optional

from distkit.errors import ConfigError

if TYPE_CHECKING:
    from distkit.env import ClusterEnv

_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: the IPv4 address of an interface


def interface_addresses() -> dict[str, str]:
    """``{interface name: IPv4 address}`` of this host's interfaces that have one (Linux)."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address (or down without one)
                continue
            out[name] = socket.inet_ntoa(packed[20:24])
    return out


@functools.lru_cache(maxsize=8)
def _resolve(host: str) -> str:
    """``host``'s IPv4 address, looked up once per process (the gloo set-up and the watchdog both
    ask for MASTER_ADDR's at start-up; a failed lookup raises and is not kept)."""
    return socket.gethostbyname(host)


def route_to(host: str) -> tuple[str, str]:
    """``(interface, local address)`` the kernel uses to reach ``host`` (a name or an IPv4 address).

    A UDP ``connect`` selects the route and sends nothing. ConfigError when ``host`` does not
    resolve or no interface holds the chosen source address."""
    try:
        ip = _resolve(host)
    except OSError as e:
        raise ConfigError(f"the rendezvous address MASTER_ADDR={host!r} does not resolve on host "
                          f"{socket.gethostname()} ({e}); export MASTER_ADDR as an IP address, or add the name to "
                          "/etc/hosts") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
        except OSError as e:
            raise ConfigError(f"host {socket.gethostname()} has no route to the rendezvous address {host} ({ip}): "
                              f"{e}; check the network, or export MASTER_ADDR as an address this host reaches") from None
        local = s.getsockname()[0]
    for name, addr in interface_addresses().items():
        if addr == local:
            return name, local
    raise ConfigError(f"no interface of host {socket.gethostname()} holds {local}, the address it reaches "
                      f"{host} from; export GLOO_SOCKET_IFNAME=<interface>")


def prepare_gloo(master_addr: str, environ: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """Set ``GLOO_SOCKET_IFNAME`` to the interface that routes to ``master_addr`` when it is unset and
    the rendezvous is not on loopback (a one-host job needs nothing); check it when it is set. Call
    on every rank before the gloo process group is created. Returns the interface, or None where
    nothing was set."""
    env = os.environ if environ is None else environ
    given = env.get("GLOO_SOCKET_IFNAME")
    if given:
        have = sorted(interface_addresses())
        missing = [n for n in given.split(",") if n not in have]
        if missing:
            raise ConfigError(f"GLOO_SOCKET_IFNAME={given}: no interface {', '.join(missing)} on host "
                              f"{socket.gethostname()} (it has {', '.join(have)}); unset it to let distkit choose "
                              "the interface that routes to MASTER_ADDR, or name one of these")
        return None
    try:
        if ipaddress.ip_address(_resolve(master_addr)).is_loopback:
            return None
    except OSError:
        pass  # route_to names the failure
    name, _ = route_to(master_addr)
    if name == "lo":
        return None
    env["GLOO_SOCKET_IFNAME"] = name
    return name


def host_identity() -> str:
    """A string equal on two processes exactly when they share a host and its network: the host name,
    the kernel's boot id and the network namespace. Hosts that share a name (containers, network
    namespaces, cloned VMs) still differ."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("")
    try:
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    except OSError:
        parts.append("")
    return "|".join(parts)


def reachable_address(master_addr: Optional[str]) -> Optional[str]:
    """This host's address on the interface that routes to ``master_addr``: where the other ranks can
    reach a server of this process (None when ``master_addr`` is None or cannot be routed)."""
    if not master_addr:
        return None
    try:
        return route_to(master_addr)[1]
    except ConfigError:
        return None


def openmpi_interface_hint(env: "ClusterEnv") -> str:
    """Across hosts under an MPI launcher, the other likely cause of a collective that never completes:
    Open MPI's TCP transport uses every interface, and one the other hosts cannot reach (Docker's
    docker0, 172.17.0.1 on every host; a management network) leaves its connections unanswered. A
    clause for a timeout message naming the mpirun option and this host's interfaces; "" on one host,
    under another launcher, or where ``OMPI_MCA_btl_tcp_if_include``/``_exclude`` is set (the user
    chose already)."""
    if env.launcher not in ("openmpi", "pmix") or env.local_world_size >= env.world_size or any(
            os.environ.get(f"OMPI_MCA_btl_tcp_if_{k}") for k in ("include", "exclude")):
        return ""
    mine = ", ".join(f"{n} {a}" for n, a in interface_addresses().items() if n != "lo")
    return (f"; or, as the job spans hosts, Open MPI connects over a network interface the other hosts cannot "
            f"reach: give mpirun --mca btl_tcp_if_include <the hosts' subnet, e.g. 10.0.0.0/24> (this host "
            f"has {mine})")


def is_ip(text: str) -> bool:
    """Whether ``text`` is an IP address (a host name cannot be bound)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def listen_address(master_addr: Optional[str], single_host: bool) -> str:
    """Where a server of this process that the job's ranks connect to through ``master_addr`` listens (issue 59:
    no job listens where it need not): a one-host job on loopback (``master_addr``'s own loopback address, else
    127.0.0.1); across hosts this host's address that ``master_addr`` names, else the one on the interface that
    routes to it (the interface the ranks share, as gloo's). "" (every interface) only where neither is known:
    a host name that resolves to loopback on rank 0's host (Debian's 127.0.1.1) in a job of several hosts, whose
    other hosts reach it at an address this host cannot tell."""
    ip: Optional[str] = None
    if master_addr:
        try:
            ip = _resolve(master_addr)
        except OSError:
            ip = None
    loopback = ip is not None and ipaddress.ip_address(ip).is_loopback
    if single_host:
        return ip if loopback else "127.0.0.1"
    if loopback:
        return ""
    return ip if ip in interface_addresses().values() else reachable_address(master_addr) or ""


def serve_store(bind: str, port: int, world_size: Optional[int], timeout: datetime.timedelta,
                wait_for_workers: bool = False) -> Any:
    """A ``torch.distributed.TCPStore`` server on ``bind``:``port`` (0: a free port) only. torch's server listens on
    every interface whatever host it is given (measured: ``TCPStore("127.0.0.1", 0, is_master=True)`` listens on
    ``*``), so the socket is bound here and handed to it (``master_listen_fd``); ``bind`` "" keeps torch's own.
    A taken port raises RuntimeError naming EADDRINUSE, as torch's own bind does."""
    import torch.distributed as dist

    if not bind:
        return dist.TCPStore("0.0.0.0", port, world_size, True, timeout=timeout, wait_for_workers=wait_for_workers)
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as torch sets it: a port in TIME_WAIT)
        try:
            sock.bind((bind, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise RuntimeError(f"EADDRINUSE: {bind}:{port} is taken ({e})") from None
            raise
        sock.listen(socket.SOMAXCONN)
        store = dist.TCPStore(bind, sock.getsockname()[1], world_size, True, timeout=timeout,
                              wait_for_workers=wait_for_workers, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now
    return store

