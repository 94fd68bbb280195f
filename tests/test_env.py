"""Tests for distkit.env: launcher detection, SLURM nodelists, derived ports, rendezvous."""
from __future__ import annotations

import pytest

from distkit.env import ClusterEnv, derive_port, detect, expand_slurm_nodelist, resolve_rendezvous
from distkit.errors import ConfigError


def _fields(env: ClusterEnv) -> tuple:
    return (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank, env.num_nodes)


TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "abc123", "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
}

SLURM_STEP = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "6", "SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
    "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "3", "SLURM_JOB_NUM_NODES": "3",
    "SLURM_STEP_NODELIST": "node[01-03]", "SLURM_JOB_NODELIST": "node[01-03]",
}


def test_torchrun() -> None:
    env = detect(TORCHRUN)
    assert env.launcher == "torchrun"
    assert _fields(env) == (5, 1, 8, 4, 1, 2)
    assert (env.master_addr, env.master_port, env.job_id) == ("10.0.0.1", 29500, "abc123")
    assert env.is_distributed


def test_torch_distributed_launch_uneven_nodes_rounds_up() -> None:
    # torch.distributed.launch in torch 2.x sets the torchelastic variables too.
    env = detect({"TORCHELASTIC_RUN_ID": "none", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3",
                  "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"})
    assert env.launcher == "torchrun"
    assert (env.num_nodes, env.local_world_size, env.master_port) == (2, 2, 1234)


def test_slurm_step() -> None:
    env = detect(SLURM_STEP)
    assert env.launcher == "slurm"
    assert _fields(env) == (3, 1, 6, 2, 1, 3)
    assert (env.job_id, env.nodelist, env.master_addr, env.master_port) == ("4242", "node[01-03]", None, None)


def test_slurm_heterogeneous_tasks_per_node() -> None:
    env = detect({"SLURM_STEPID": "1", "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS": "3",
                  "SLURM_TASKS_PER_NODE": "2,1", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
                  "SLURM_JOB_NODELIST": "a,b"})
    assert _fields(env) == (2, 0, 3, 1, 1, 2)


def test_slurm_batch_script_without_step_is_single() -> None:
    batch = {k: v for k, v in SLURM_STEP.items() if k not in ("SLURM_STEP_ID",)}
    env = detect(batch)
    assert env.launcher == "single"
    assert _fields(env) == (0, 0, 1, 1, 0, 1)
    assert not env.is_distributed


def test_openmpi() -> None:
    env = detect({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1",
                  "OMPI_MCA_ess_base_jobid": "77"})
    assert env.launcher == "openmpi"
    assert _fields(env) == (3, 1, 4, 2, 1, 2)
    assert (env.job_id, env.master_addr, env.master_port) == ("77", None, None)


def test_openmpi5_job_id_from_pmix_namespace() -> None:
    env = detect({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": "0",
                  "PMIX_NAMESPACE": "prterun-host-123@1", "MASTER_ADDR": "h0", "MASTER_PORT": "4000"})
    assert (env.launcher, env.job_id, env.master_addr, env.master_port) == (
        "openmpi", "prterun-host-123@1", "h0", 4000)


def test_mpich_hydra() -> None:
    env = detect({"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"})
    assert env.launcher == "mpich"
    assert _fields(env) == (5, 1, 8, 4, 1, 2)


def test_pmix_with_size() -> None:
    env = detect({"PMIX_RANK": "1", "PMIX_SIZE": "2", "PMIX_NAMESPACE": "ns1"})
    assert (env.launcher, env.rank, env.world_size, env.job_id) == ("pmix", 1, 2, "ns1")


def test_pmix_without_size_raises() -> None:
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        detect({"PMIX_RANK": "0", "PMIX_NAMESPACE": "ns1"})


def test_horovodrun_gloo() -> None:
    env = detect({"HOROVOD_RANK": "2", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "2",
                  "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
                  "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.1.1.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "5555"})
    assert env.launcher == "horovodrun"
    assert _fields(env) == (2, 0, 4, 2, 1, 2)
    assert env.job_id == "horovod-10.1.1.1:5555"


def test_spawn() -> None:
    env = detect({"DISTKIT_SPAWN_ID": "sp-9", "RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4",
                  "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "23456"})
    assert env.launcher == "spawn"
    assert _fields(env) == (2, 2, 4, 4, 0, 1)
    assert (env.job_id, env.master_port) == ("sp-9", 23456)


def test_deepspeed_launcher() -> None:
    # Variables deepspeed/launcher/launch.py exports to each child.
    env = detect({"RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "MASTER_ADDR": "ds0", "MASTER_PORT": "29500",
                  "CROSS_RANK": "1", "CROSS_SIZE": "2", "LOCAL_SIZE": "4"})
    assert env.launcher == "deepspeed"
    assert _fields(env) == (6, 2, 8, 4, 1, 2)
    assert (env.master_addr, env.master_port) == ("ds0", 29500)


def test_generic_env_defaults() -> None:
    env = detect({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "m", "MASTER_PORT": "1"})
    assert env.launcher == "env"
    assert _fields(env) == (3, 3, 4, 4, 0, 1)
    env2 = detect({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert (env2.local_rank, env2.node_rank, env2.num_nodes) == (1, 1, 2)
    env3 = detect({"RANK": "0", "WORLD_SIZE": "1"})
    assert (env3.launcher, env3.local_rank, env3.is_distributed) == ("env", 0, False)


def test_single_process() -> None:
    env = detect({"PATH": "/usr/bin", "HOME": "/root"})
    assert env.launcher == "single"
    assert _fields(env) == (0, 0, 1, 1, 0, 1)
    assert (env.master_addr, env.master_port, env.job_id) == (None, None, None)


def test_torchelastic_beats_slurm() -> None:
    env = detect({**SLURM_STEP, **TORCHRUN})
    assert env.launcher == "torchrun"
    assert (env.rank, env.world_size) == (5, 8)


def test_mpirun_inside_slurm_allocation_is_openmpi() -> None:
    # mpirun's daemons are one srun task per node: SLURM says 2 tasks, Open MPI says 8 ranks.
    env = detect({"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
                  "SLURM_NTASKS": "2", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
                  "OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "1"})
    assert env.launcher == "openmpi"
    assert _fields(env) == (6, 2, 8, 4, 1, 2)


def test_slurm_with_agreeing_openmpi_stays_slurm() -> None:
    env = detect({**SLURM_STEP, "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_RANK": "3"})
    assert env.launcher == "slurm"


def test_non_integer_rank_raises_naming_variable() -> None:
    with pytest.raises(ConfigError, match="RANK='x'"):
        detect({"RANK": "x", "WORLD_SIZE": "2"})


def test_rank_not_below_world_raises() -> None:
    with pytest.raises(ConfigError, match="rank 4 is outside 0..3"):
        detect({"RANK": "4", "WORLD_SIZE": "4"})


def test_zero_world_raises() -> None:
    with pytest.raises(ConfigError, match="< 1"):
        detect({"RANK": "0", "WORLD_SIZE": "0"})


def test_bad_master_port_raises() -> None:
    with pytest.raises(ConfigError, match="MASTER_PORT"):
        detect({**TORCHRUN, "MASTER_PORT": "http"})
    with pytest.raises(ConfigError, match="MASTER_PORT=70000"):
        detect({**TORCHRUN, "MASTER_PORT": "70000"})


def test_detect_does_not_read_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert detect({}).launcher == "single"


@pytest.mark.parametrize(("nodelist", "expected"), [
    ("node[01-03,07],gpu7", ["node01", "node02", "node03", "node07", "gpu7"]),
    ("gpu7", ["gpu7"]),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("x[9-10],y", ["x9", "x10", "y"]),
    ("rack1-[1-2]", ["rack1-1", "rack1-2"]),
    ("", []),
])
def test_expand_slurm_nodelist(nodelist: str, expected: list[str]) -> None:
    assert expand_slurm_nodelist(nodelist) == expected


@pytest.mark.parametrize("bad", ["node[01-03", "node[3-1]", "node[a-b]", "node]1["])
def test_expand_slurm_nodelist_malformed(bad: str) -> None:
    with pytest.raises(ConfigError):
        expand_slurm_nodelist(bad)


def test_derive_port() -> None:
    p = derive_port("4242")
    assert p == derive_port("4242")
    assert 20000 <= p < 30000
    assert p != derive_port("4243")
    q = derive_port("4242", base=40000, span=100)
    assert 40000 <= q < 40100
    assert 20000 <= derive_port(None) < 30000


def test_free_port_stays_out_of_the_kernels_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CI failure this prevents: the spawner's port, found free by a bind to port 0 and closed, was handed by the
    kernel to another job's bind(0) before rank 0 bound it (PortInUse). Picks come from PICK_PORTS outside the
    ephemeral range, skip a port someone holds, and differ across processes that seeded ``random`` alike."""
    import random
    import socket

    from distkit import env as env_mod

    lo, hi = (int(v) for v in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))  # what the kernel hands out for port 0 now
        picks = []
        for _ in range(40):
            random.seed(0)  # (a script's seed, inherited by every forked rank)
            picks.append(env_mod.free_port("127.0.0.1"))
        assert held.getsockname()[1] not in picks
    assert all(p in env_mod.PICK_PORTS and not lo <= p <= hi for p in picks)
    assert len(set(picks)) > 30  # (40 draws from ~10,000 ports)
    two = range(picks[0], picks[0] + 2)
    monkeypatch.setattr(env_mod, "PICK_PORTS", two)
    with socket.socket() as held:
        held.bind(("127.0.0.1", two[0]))
        held.listen()
        assert {env_mod.free_port("127.0.0.1") for _ in range(20)} == {two[1]}


def test_resolve_rendezvous_explicit_wins() -> None:
    assert resolve_rendezvous(detect(TORCHRUN)) == ("10.0.0.1", 29500)


def test_resolve_rendezvous_slurm() -> None:
    assert resolve_rendezvous(detect(SLURM_STEP)) == ("node01", derive_port("4242"))
    # A MASTER_ADDR alone is kept; the port is still derived.
    env = detect({**SLURM_STEP, "MASTER_ADDR": "login9"})
    assert resolve_rendezvous(env) == ("login9", derive_port("4242"))


def test_resolve_rendezvous_single_node_openmpi() -> None:
    env = detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "0",
                  "OMPI_MCA_ess_base_jobid": "31337"})
    assert resolve_rendezvous(env) == ("127.0.0.1", derive_port("31337"))


def test_resolve_rendezvous_single() -> None:
    addr, port = resolve_rendezvous(detect({}))
    assert addr == "127.0.0.1"
    assert 0 < port < 65536


def test_resolve_rendezvous_generic_multi_rank_without_master_raises() -> None:
    with pytest.raises(ConfigError, match="export MASTER_ADDR"):
        resolve_rendezvous(detect({"RANK": "0", "WORLD_SIZE": "2"}))
