"""Several "hosts" on one machine for multi-host tests: Linux network namespaces joined by a bridge.

Each host is a network namespace with one veth interface (``eth0`` inside) on a private /24, its own
hostname (commands run under ``unshare --uts``) and an ``/etc/hosts`` that maps every host name to its
address (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts`` over ``/etc/hosts``), as real hosts
have. The file system is shared, as a cluster's shared file system is. Links can be shaped with
``tbf`` (a rate per host, both directions); ``netem`` does not exist on this kernel.

Everything is named ``dkt<id>...`` (namespaces, the bridge, the veth ends), and :meth:`Hosts.close`
removes it, also when a test fails; :func:`remove_leftovers` removes what a killed test session left.
Root is required: :func:`unavailable` says why the machine cannot create namespaces, and the tests
fail with that reason instead of passing silently.

    with Hosts(2) as hosts:
        p = hosts.popen(0, ["hostname"])         # runs inside host 0 (namespace, hostname, /etc/hosts)
        hosts.addr(1)                            # "10.231.N.2"
        hosts.link_down(1)                       # cut host 1 off
        env = hosts.sshd(tmpdir)                 # a real sshd in every host; env lets pdsh log in
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from typing import Any, Optional, Sequence

from distkit.launch import procfs
from tiers import full_tier

PREFIX = "dkt"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> Optional[str]:
    """Why this machine cannot run the multi-host tests (None: it can)."""
    if os.geteuid() != 0:
        return "the multi-host tests need root (they create network namespaces)"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"the multi-host tests need the '{tool}' command (iproute2 / util-linux)"
    probe = f"{PREFIX}probe{os.getpid()}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"cannot create a network namespace here: {res.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def remove_leftovers(prefix: str = PREFIX) -> None:
    """Delete every namespace, link and hosts file whose name starts with ``prefix``: one set of hosts' (its tag),
    or, by default, what test sessions that are no longer running left. Every name carries the pid of the process
    that made it (``dkt<pid>...``); those of a live one are its own (another pytest worker building hosts at the same
    time: fc16's cut-off test lost its hosts, and its groups their processes, when the hosts tests started beside
    it and removed every ``dkt`` name)."""
    def leftover(name: str) -> bool:
        if not name.startswith(prefix):
            return False
        owner = re.match(rf"{PREFIX}(?:probe)?(\d+)", name) if prefix == PREFIX else None
        return owner is None or procfs.state(int(owner.group(1))) is None  # its owner is gone

    names = _ip("netns", "list", check=False).stdout.split()
    for ns in [n for n in names if leftover(n)]:
        _kill_inside(ns)
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if leftover(name):
            _ip("link", "del", name, check=False)


def _kill_inside(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


@full_tier("network-namespace hosts")
class Hosts:
    """``n`` hosts on one bridge, addresses ``10.231.<net>.<i+1>``; hostnames ``<tag>h<i>``."""

    def __init__(self, n: int, rate_mbit: Optional[float] = None, tag: Optional[str] = None,
                 own_hostnames: bool = True) -> None:
        """``own_hostnames=False``: every host keeps this machine's host name, which resolves to
        ``127.0.1.1`` inside each of them (Debian's default), the setting that breaks gloo's choice."""
        self.n = n
        self.own_hostnames = own_hostnames
        self.tag = tag or f"{PREFIX}{os.getpid()}"  # the owner's pid (remove_leftovers); at most 12 of 15 characters
        self.net = 1 + os.getpid() % 250  # concurrent sessions (CI beside a developer) get other subnets
        self.names = [f"{self.tag}h{i}" for i in range(n)]
        self.bridge = f"{self.tag}br"
        self.rate_mbit = rate_mbit
        self._up = False

    # -- set-up / tear-down ------------------------------------------------------------------------
    def __enter__(self) -> "Hosts":
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            outer, inner = f"{self.tag}p{i}", f"{self.tag}v{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "link", "set", inner, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                shared = "" if self.own_hostnames else f"127.0.1.1 {socket.gethostname()}\n"
                f.write("127.0.0.1 localhost\n" + shared
                        + "".join(f"{self.addr(j)} {name}\n" for j, name in enumerate(self.names)))
        self._up = True
        if self.rate_mbit is not None:
            self.shape(self.rate_mbit)

    def close(self) -> None:
        """Kill every process inside the hosts and remove namespaces, links and hosts files."""
        remove_leftovers(self.tag)

    # -- use -------------------------------------------------------------------------------------------
    def addr(self, i: int) -> str:
        return f"10.231.{self.net}.{i + 1}"

    @property
    def cidr(self) -> str:
        return f"10.231.{self.net}.0/24"

    def wrap(self, i: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as run inside host ``i``: its namespace, its own hostname."""
        if not self.own_hostnames:
            return ["ip", "netns", "exec", self.names[i], *cmd]
        return ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c",
                f'hostname {self.names[i]} && exec "$@"', "sh", *cmd]

    def rsh_agent(self, directory: str) -> str:
        """Write an rsh/ssh stand-in for ``mpirun`` (``--prtemca plm_ssh_agent PATH``) into ``directory``:
        ``agent [-opts] HOST CMD...`` runs CMD (one shell string, as ssh does) inside host HOST."""
        path = os.path.join(directory, "netns-rsh")
        with open(path, "w") as f:
            f.write('#!/bin/sh\n# ssh stand-in: enter the host\'s network namespace under its own hostname; like ssh, this\n'
                    '# process stays on the launching host (no exec), so a lost host does not take it along\n'
                    'while [ "${1#-}" != "$1" ]; do shift; done\n'
                    'host=$1; shift\n'
                    'ip netns exec "$host" unshare --uts sh -c "hostname $host && $*"\n')
        os.chmod(path, 0o755)
        return path

    def sshd(self, directory: str) -> dict[str, str]:
        """Start a real OpenSSH server inside every host (on its own address, port 22, under its own
        hostname), with a host key and one authorised client key made in ``directory``; return the
        environment with which ``pdsh -R ssh`` (DeepSpeed's default launcher) logs in with that key.

        Root's own ``~/.ssh`` is left alone, so a plain ``ssh HOST`` (DeepSpeed's ssh check) is not
        let in: callers pass ``--no_ssh_check``. Needs ``/usr/sbin/sshd`` and ``pdsh``
        (``scripts/install_pdsh.sh``, which ``make test`` runs); the servers die with :meth:`close`."""
        if not os.access("/usr/sbin/sshd", os.X_OK) or shutil.which("pdsh") is None:
            raise RuntimeError("sshd or pdsh is missing: run scripts/install_pdsh.sh (make test does)")
        key, host_key = os.path.join(directory, "id"), os.path.join(directory, "host_key")
        for path in (key, host_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True, capture_output=True)
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory (made by its service unit)
        for i in range(self.n):
            conf = os.path.join(directory, f"sshd{i}.conf")
            with open(conf, "w") as f:
                # StrictModes no: the keys live in a test directory, not a private ~/.ssh
                f.write(f"ListenAddress {self.addr(i)}\nHostKey {host_key}\nAuthorizedKeysFile {key}.pub\n"
                        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nStrictModes no\nUsePAM no\n"
                        f"PidFile {os.path.join(directory, f'sshd{i}.pid')}\n")
            subprocess.run(self.wrap(i, ["/usr/sbin/sshd", "-f", conf]), check=True, capture_output=True)
        return {"PDSH_SSH_ARGS_APPEND": f"-i {key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                                        "-o BatchMode=yes -o LogLevel=ERROR"}

    def mpirun_args(self, agent: str) -> list[str]:
        """What ``mpirun`` needs to span these hosts: the agent, the subnet for its daemons' and the TCP
        transport's traffic, no binding (each simulated host would bind its ranks to core 0)."""
        return ["--prtemca", "plm_ssh_agent", agent, "--prtemca", "oob_tcp_if_include", self.cidr,
                "--mca", "btl_tcp_if_include", self.cidr, "--mca", "btl", "self,tcp", "--bind-to", "none"]

    def add_private_interface(self, name: str = "mgmt0", subnet: str = "172.30") -> None:
        """Give every host a second interface, ``subnet.0.(i+1)/16`` on host i, that is up and routed but
        joined to nothing (as a management or storage network that does not span the hosts): a
        connection from one host to another's address on it is never answered, not even refused (the
        other hosts' addresses have fixed neighbour entries, so no failed ARP says "no route"). A
        veth pair inside each namespace (this kernel has no ``dummy`` links)."""
        for i, ns in enumerate(self.names):
            inside = ["ip", "netns", "exec", ns, "ip"]
            subprocess.run([*inside, "link", "add", name, "type", "veth", "peer", "name", f"{name}p"], check=True,
                           capture_output=True)
            subprocess.run([*inside, "addr", "add", f"{subnet}.0.{i + 1}/16", "dev", name], check=True,
                           capture_output=True)
            for dev in (name, f"{name}p"):
                subprocess.run([*inside, "link", "set", dev, "up"], check=True, capture_output=True)
            for j in range(self.n):
                if j != i:
                    subprocess.run([*inside, "neigh", "replace", f"{subnet}.0.{j + 1}", "lladdr",
                                    f"02:00:00:00:00:{j + 1:02x}", "dev", name, "nud", "permanent"],
                                   check=True, capture_output=True)

    def popen(self, i: int, cmd: Sequence[str], **kwargs: Any) -> "subprocess.Popen[str]":
        return subprocess.Popen(self.wrap(i, cmd), text=True, **kwargs)

    def shape(self, rate_mbit: float) -> None:
        """Limit every host's link to ``rate_mbit`` Mbit/s in both directions (tbf)."""
        # tbf reaches its rate only with a bucket of at least rate / HZ (tc-tbf(8); HZ = 250 here): with a
        # fixed 4 KB bucket a 1000 Mbit/s link gave 290-715 Mbit/s, varying from day to day, while 25 and
        # 100 Mbit/s matched the step-time model. 4 ms of the rate, at least 4 KB.
        burst = max(4096, int(rate_mbit * 1e6 / 8 * 0.004))
        for i, ns in enumerate(self.names):
            # tbf shapes what leaves an interface: the host's eth0 (host -> bridge) and its bridge-side end
            for inside, dev in ((["ip", "netns", "exec", ns], "eth0"), ([], f"{self.tag}p{i}")):
                subprocess.run([*inside, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                                "burst", str(burst), "latency", "400ms"], check=True, capture_output=True)

    def link_down(self, i: int) -> None:
        """Cut host ``i`` off the bridge (its processes stay alive)."""
        _ip("link", "set", f"{self.tag}p{i}", "down")

    def pids(self, i: int) -> list[int]:
        """Every process running inside host ``i``."""
        return [int(p) for p in _ip("netns", "pids", self.names[i], check=False).stdout.split()]

    def kill(self, i: int, sig: int = 9) -> None:
        """Send ``sig`` to every process inside host ``i``."""
        for pid in self.pids(i):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
