"""Who am I in the job? Rank, world size and rendezvous address, read once from the launcher.

:func:`detect` is a pure function of an environment mapping: it recognises torchrun /
``torch.distributed.launch``, SLURM ``srun`` steps, Open MPI / MPICH / PMIx, horovodrun
(gloo), distkit's own spawner, the deepspeed launcher, a hand-set ``RANK``/``WORLD_SIZE``,
or a plain single process (priority in that order, DESIGN.md section 5).
:func:`resolve_rendezvous` turns the result into a ``(master_addr, master_port)`` pair that
every rank agrees on, without the user exporting anything where the launcher allows it.
"""
from __future__ import annotations

import itertools
import re
import socket
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from distkit.errors import BackendUnavailable, ConfigError

LAUNCHERS = ("torchrun", "slurm", "openmpi", "mpich", "pmix", "horovodrun", "deepspeed", "env", "spawn", "single")


class Collectives(Protocol):
    """What a rank can do with the others: the part of every engine's Strategy
    (:class:`distkit.backends.base.Strategy`) that code below the engines uses (checkpoint writing, the portable
    part, ``run_on_main``, the tasks' agreed errors). Typed by this protocol, such code never imports an engine."""

    rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        """Global rank 0."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Collective: every rank must call it, in the same order. Returns ``src``'s object."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Collective: every rank must call it, in the same order. Returns one object per rank, in rank order."""

    def barrier(self) -> None:
        """Collective: every rank must call it, in the same order."""


@dataclass(frozen=True)
class ClusterEnv:
    """This process's place in the job, as the launcher described it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str | None
    master_port: int | None
    launcher: str
    job_id: str | None
    nodelist: str | None
    #: torchrun's agent already serves the rendezvous store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE)
    agent_store: bool = False

    @property
    def is_distributed(self) -> bool:
        """True when more than one rank takes part."""
        return self.world_size > 1


def _get(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """First of ``names`` set to a non-empty value, as (name, value); empty counts as unset."""
    for name in names:
        value = env.get(name)
        if value is not None and value.strip() != "":
            return name, value.strip()
    return None


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int | None:
    """Integer value of the first set variable in ``names``; ConfigError naming it if malformed."""
    found = _get(env, *names)
    if found is None:
        return default
    name, value = found
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer; unset it or export a whole number") from None


def _master(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    addr = _get(env, "MASTER_ADDR")
    port = _int(env, "MASTER_PORT")
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"MASTER_PORT={port} is not a TCP port; export MASTER_PORT between 1 and 65535")
    return (addr[1] if addr else None), port


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _tasks_on_node(spec: str | None, node_rank: int) -> int | None:
    """Tasks on node ``node_rank`` from SLURM's "2(x3),1" form; None if unparseable."""
    if not spec:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return None
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    # Heterogeneous layouts ("2,1") give each node its own count; fall back to the first.
    return counts[node_rank] if 0 <= node_rank < len(counts) else counts[0]


def _build(env: Mapping[str, str], launcher: str, rank: int | None, world: int | None, *,
           local_rank: int | None, local_world: int | None, node_rank: int | None,
           num_nodes: int | None, job_id: str | None = None, nodelist: str | None = None) -> ClusterEnv:
    """Fill the gaps the launcher left, validate, and freeze."""
    assert rank is not None and world is not None
    if world < 1:
        raise ConfigError(f"world size {world} from the {launcher} launcher is < 1; launch at least one process")
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside 0..{world - 1} (world size {world}, launcher {launcher}); "
                          "fix RANK/WORLD_SIZE or the launcher's task count")
    if local_world is None:
        # Unknown layout: assume one node holds every rank (true for every default we reach here).
        local_world = world if num_nodes is None else _ceil_div(world, max(num_nodes, 1))
    if local_rank is None:
        local_rank = 0 if world == 1 else rank % local_world
    if num_nodes is None:
        num_nodes = _ceil_div(world, local_world)
    if node_rank is None:
        node_rank = rank // local_world
    if not (1 <= local_world <= world and 0 <= local_rank < local_world and 0 <= node_rank < num_nodes):
        raise ConfigError(f"inconsistent layout from the {launcher} launcher: local rank {local_rank} of "
                          f"{local_world}, node {node_rank} of {num_nodes}, world {world}; check LOCAL_RANK/"
                          "LOCAL_WORLD_SIZE (or the launcher's per-node task count)")
    addr, port = _master(env)
    return ClusterEnv(rank, local_rank, world, local_world, node_rank, num_nodes, addr, port, launcher,
                      job_id, nodelist, env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def detect(environ: Mapping[str, str]) -> ClusterEnv:
    """Read this process's rank layout from ``environ`` (pure: no os.environ, no I/O).

    Cross-rank contract: every rank of one job, given its own environment, gets the same
    ``world_size``, ``launcher``, ``job_id`` and ``nodelist``. Raises ConfigError on values
    that are not integers or do not fit together (e.g. rank >= world size).
    """
    e = environ
    # 1. torchelastic: torchrun, and torch.distributed.launch (torchrun underneath in torch 2.x).
    if _get(e, "TORCHELASTIC_RUN_ID"):
        world, lw = _int(e, "WORLD_SIZE", default=1), _int(e, "LOCAL_WORLD_SIZE")
        return _build(e, "torchrun", _int(e, "RANK", default=0), world, local_rank=_int(e, "LOCAL_RANK"),
                      local_world=lw, node_rank=_int(e, "GROUP_RANK"),
                      num_nodes=_ceil_div(world, lw) if world and lw else None, job_id=e["TORCHELASTIC_RUN_ID"])
    # 2. SLURM srun step. The batch script of sbatch (or an salloc shell) has no step id and is
    # one process, not rank 0 of SLURM_NTASKS, so it must fall through to "single".
    slurm_world = _int(e, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    ompi_world = _int(e, "OMPI_COMM_WORLD_SIZE")
    # mpirun inside an allocation starts its daemons through srun, so ranks inherit the daemon
    # step's SLURM_* (one task per node); a disagreeing Open MPI size means mpirun is the launcher.
    mpirun_in_slurm = ompi_world is not None and ompi_world != slurm_world
    if _get(e, "SLURM_STEP_ID", "SLURM_STEPID") and _get(e, "SLURM_PROCID") and not mpirun_in_slurm:
        node_rank = _int(e, "SLURM_NODEID")
        nodes = _int(e, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
        tpn = _get(e, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        nl = _get(e, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
        jid = _get(e, "SLURM_JOB_ID", "SLURM_JOBID")
        return _build(e, "slurm", _int(e, "SLURM_PROCID"), slurm_world if slurm_world is not None else 1,
                      local_rank=_int(e, "SLURM_LOCALID"), local_world=_tasks_on_node(tpn[1] if tpn else None,
                                                                                    node_rank or 0),
                      node_rank=node_rank, num_nodes=nodes, job_id=jid[1] if jid else None,
                      nodelist=nl[1] if nl else None)
    # 3. MPI launchers.
    if _get(e, "OMPI_COMM_WORLD_RANK"):
        jid = _get(e, "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")  # Open MPI 4 / Open MPI 5 (PRRTE)
        return _build(e, "openmpi", _int(e, "OMPI_COMM_WORLD_RANK"), ompi_world if ompi_world is not None else 1,
                      local_rank=_int(e, "OMPI_COMM_WORLD_LOCAL_RANK"),
                      local_world=_int(e, "OMPI_COMM_WORLD_LOCAL_SIZE"),
                      node_rank=None, num_nodes=None, job_id=jid[1] if jid else None)
    if _get(e, "PMI_RANK") and _get(e, "PMI_SIZE"):  # MPICH / Intel MPI hydra
        # Hydra exports no job id (PMIx builds do): without one, concurrent jobs on a node share a port.
        jid = _get(e, "PMIX_NAMESPACE")
        return _build(e, "mpich", _int(e, "PMI_RANK"), _int(e, "PMI_SIZE"), local_rank=_int(e, "MPI_LOCALRANKID"),
                      local_world=_int(e, "MPI_LOCALNRANKS"), node_rank=None, num_nodes=None,
                      job_id=jid[1] if jid else None)
    if _get(e, "PMIX_RANK"):
        size = _int(e, "PMIX_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE")
        if size is None:
            raise ConfigError("PMIX_RANK is set but no world size is (PMIX_SIZE, OMPI_COMM_WORLD_SIZE); "
                              "launch with mpirun/Open MPI or set WORLD_SIZE")
        jid = _get(e, "PMIX_NAMESPACE")
        return _build(e, "pmix", _int(e, "PMIX_RANK"), size, local_rank=_int(e, "OMPI_COMM_WORLD_LOCAL_RANK",
                                                                             "LOCAL_RANK"),
                      local_world=_int(e, "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE"), node_rank=None,
                      num_nodes=None, job_id=jid[1] if jid else None)
    if _get(e, "HOROVOD_RANK") and _get(e, "HOROVOD_SIZE") and _get(e, "HOROVOD_GLOO_RENDEZVOUS_ADDR"):
        # The rendezvous server's addr:port is unique per running horovodrun: a usable job id.
        hvd_id = f"horovod-{e['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:{e.get('HOROVOD_GLOO_RENDEZVOUS_PORT', '')}"
        return _build(e, "horovodrun", _int(e, "HOROVOD_RANK"), _int(e, "HOROVOD_SIZE"),
                      local_rank=_int(e, "HOROVOD_LOCAL_RANK"), local_world=_int(e, "HOROVOD_LOCAL_SIZE"),
                      node_rank=_int(e, "HOROVOD_CROSS_RANK"), num_nodes=_int(e, "HOROVOD_CROSS_SIZE"), job_id=hvd_id)
    # 4. distkit's own spawner (one node; it always exports MASTER_ADDR/MASTER_PORT).
    if _get(e, "DISTKIT_SPAWN_ID"):
        return _build(e, "spawn", _int(e, "RANK", default=0), _int(e, "WORLD_SIZE", default=1),
                      local_rank=_int(e, "LOCAL_RANK"), local_world=_int(e, "LOCAL_WORLD_SIZE"),
                      node_rank=_int(e, "GROUP_RANK"), num_nodes=None, job_id=e["DISTKIT_SPAWN_ID"])
    # 5. deepspeed launcher (deepspeed/launcher/launch.py): besides RANK/LOCAL_RANK/WORLD_SIZE/
    # MASTER_* it exports CROSS_RANK (node rank), CROSS_SIZE (nodes) and LOCAL_SIZE.
    if _get(e, "RANK") and _get(e, "WORLD_SIZE") and _get(e, "CROSS_RANK") and _get(e, "CROSS_SIZE") \
            and _get(e, "LOCAL_SIZE"):
        return _build(e, "deepspeed", _int(e, "RANK"), _int(e, "WORLD_SIZE"), local_rank=_int(e, "LOCAL_RANK"),
                      local_world=_int(e, "LOCAL_SIZE"), node_rank=_int(e, "CROSS_RANK"),
                      num_nodes=_int(e, "CROSS_SIZE"))
    # 6. RANK/WORLD_SIZE set by hand or by a launcher we do not know. Without LOCAL_WORLD_SIZE we
    # assume one node, so LOCAL_RANK defaults to RANK % LOCAL_WORLD_SIZE, else RANK (0 when world is 1).
    if _get(e, "RANK") and _get(e, "WORLD_SIZE"):
        return _build(e, "env", _int(e, "RANK"), _int(e, "WORLD_SIZE"), local_rank=_int(e, "LOCAL_RANK"),
                      local_world=_int(e, "LOCAL_WORLD_SIZE"), node_rank=_int(e, "GROUP_RANK", "NODE_RANK"),
                      num_nodes=_int(e, "NNODES", "NUM_NODES"))
    # 7. A plain `python train.py`.
    return _build(e, "single", 0, 1, local_rank=0, local_world=1, node_rank=0, num_nodes=1)


#: the variables of a rank's place that a hand-set (or leftover) job is made of: case 6 of :func:`detect`
_HAND_SET = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "NNODES", "NUM_NODES")


def check_launched(env: ClusterEnv, environ: Mapping[str, str]) -> ClusterEnv:
    """ConfigError (bad input, exit 2) at once for ``RANK``/``WORLD_SIZE`` > 1 that no launcher set: no launcher's own
    variables (torchrun, srun, mpirun, horovodrun, deepspeed, distkit's spawner) and no ``MASTER_ADDR``/``MASTER_PORT``
    to meet at, as a shell's leftover ``export RANK=0 WORLD_SIZE=2`` leaves them (the run then waited for a rank 1
    that never comes, or failed after start-up naming MASTER_ADDR). Returns ``env``. Not collective; pure."""
    if env.launcher != "env" or not env.is_distributed or env.master_addr is not None or env.master_port is not None:
        return env
    found = [(n, v) for n, v in ((n, _get(environ, n)) for n in _HAND_SET) if v is not None]
    raise ConfigError(f"{' '.join(f'{n}={v[1]}' for n, v in found)} in the environment, but no launcher set them (no "
                      "MASTER_ADDR/MASTER_PORT, no torchrun, mpirun or srun variables), so no other rank will come: "
                      f"unset {' '.join(n for n, _ in found)} to run here (--nprocs N starts N ranks), or start the "
                      "ranks with torchrun/mpirun/srun (or export MASTER_ADDR and MASTER_PORT when starting them by hand)")


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list, in order: "node[01-03,07],gpu7" -> node01..node03, node07, gpu7.

    Zero padding follows the range start's width; several bracket groups ("a[1-2]b[3-4]") expand as a
    cartesian product, leftmost group outermost. Pure; ConfigError on malformed input.
    """
    hosts: list[str] = []
    items = re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist.strip())  # commas outside brackets
    if ",".join(items) != nodelist.strip():
        raise ConfigError(f"malformed SLURM nodelist {nodelist!r}; export MASTER_ADDR to bypass nodelist parsing")
    for item in items:
        parts: list[list[str]] = []
        for literal, group in re.findall(r"([^\[\]]+)|\[([^\]]*)\]", item):
            if literal:
                parts.append([literal])
                continue
            choices: list[str] = []
            for rng in group.split(","):
                m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", rng)
                if m is None or (m.group(2) and int(m.group(2)) < int(m.group(1))):
                    raise ConfigError(f"bad range {rng!r} in SLURM nodelist {nodelist!r}; "
                                      "export MASTER_ADDR to bypass nodelist parsing")
                lo, hi, width = int(m.group(1)), int(m.group(2) or m.group(1)), len(m.group(1))
                choices.extend(str(i).zfill(width) for i in range(lo, hi + 1))
            parts.append(choices)
        if "".join(re.findall(r"[^\[\]]+|\[[^\]]*\]", item)) != item:
            raise ConfigError(f"unbalanced brackets in SLURM nodelist {nodelist!r}; "
                              "export MASTER_ADDR to bypass nodelist parsing")
        hosts.extend("".join(p) for p in itertools.product(*parts))
    return hosts


def derive_port(job_id: str | None, base: int = 20000, span: int = 10000) -> int:
    """A TCP port in ``[base, base + span)`` computed from ``job_id`` alone.

    Every rank gets the same answer (crc32 is stable across processes, unlike ``hash()``), and two
    jobs with different ids get different ports with high probability (best effort, not a guarantee).
    """
    return base + zlib.crc32(f"distkit:{job_id or ''}".encode()) % span


#: the ports :func:`free_port` draws from, where the kernel's ephemeral range leaves them free
PICK_PORTS = range(10000, 20000)


def free_port(host: str = "") -> int:
    """A TCP port nobody on ``host`` ("": every interface) is bound to now, for a rendezvous that a rank binds
    moments later (a small race with other jobs picking ports the same way: accepted).

    Drawn at random from :data:`PICK_PORTS` (below :func:`derive_port`'s 20000-29999 and Linux's ephemeral range,
    32768-60999 by default), not by binding port 0: the kernel hands the port it just took back to the next
    ``bind(0)``/``connect`` of any process on the host (the gloo pairs, stores and MPI links of every other job
    draw from that range), and a CI run lost 7 tests to a rank 0 finding its spawner's port taken that way.
    ``SystemRandom``: ranks forked from a script that seeded ``random`` would otherwise all draw the same port."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999  # (Linux's default; elsewhere a taken port is skipped by the bind below anyway)
    ports = [p for p in PICK_PORTS if not lo <= p <= hi]
    draw = random.SystemRandom()
    for _ in range(64 if ports else 0):
        port = draw.choice(ports)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))  # (no SO_REUSEADDR: a port in TIME_WAIT is passed over too)
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room outside the ephemeral range
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _my_address() -> str:
    name = socket.gethostname()
    try:
        addr = socket.gethostbyname(name)
    except OSError:
        return name
    # Debian-style /etc/hosts maps the hostname to 127.0.1.1, useless to other nodes.
    return name if addr.startswith("127.") else addr


def resolve_rendezvous(env: ClusterEnv) -> tuple[str, int]:
    """Return ``(master_addr, master_port)`` for process-group init; every rank gets the same answer.

    Not pure: may bind a socket, and under multi-node MPI it calls mpi4py (a collective, so every
    rank must call this). Launcher-given values win; otherwise SLURM uses the first host of the
    nodelist (rank 0's node under srun's block distribution) and a port derived from the job id.
    """
    addr, port = env.master_addr, env.master_port
    if addr is not None and port is not None:
        return addr, port
    if not env.is_distributed:
        return addr or "127.0.0.1", port or free_port("127.0.0.1")
    one_node = env.num_nodes == 1 or env.local_world_size == env.world_size
    if env.launcher == "slurm":
        hosts = expand_slurm_nodelist(env.nodelist or "")
        if addr is None and not hosts:
            raise ConfigError("SLURM gave no nodelist (SLURM_STEP_NODELIST/SLURM_JOB_NODELIST); "
                              "export MASTER_ADDR and MASTER_PORT")
        return addr or hosts[0], port or derive_port(env.job_id)
    if env.launcher in ("openmpi", "mpich", "pmix", "horovodrun") and one_node:
        return addr or "127.0.0.1", port or derive_port(env.job_id)
    if env.launcher in ("openmpi", "mpich", "pmix"):
        try:
            from mpi4py import MPI
        except ImportError:
            raise BackendUnavailable("multi-node DDP under mpirun needs mpi4py: pip install 'distkit[mpi]' "
                                     "(or export MASTER_ADDR and MASTER_PORT)") from None
        comm = MPI.COMM_WORLD
        pair = (addr or _my_address(), port or free_port()) if comm.Get_rank() == 0 else None
        got = comm.bcast(pair, root=0)
        return str(got[0]), int(got[1])
    raise ConfigError(f"the {env.launcher} launcher gave no MASTER_ADDR/MASTER_PORT for {env.world_size} ranks; "
                      "export MASTER_ADDR (rank 0's host) and MASTER_PORT on every node")
