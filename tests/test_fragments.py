"""param_sync_fragments, param_sync_compression and param_sync_overlap (issue 26 items 1-3: Streaming DiLoCo's
fragments, a compressed exchange, overlapped with training) on every engine, real processes.

The model's tensors, cut into F runs of whole parameters (the same cut on every engine, ZeRO's partitioned
masters included), sync at staggered steps; with the outer optimizer each has its own anchor and momentum. With
int8 compression each rank's pseudo-gradient crosses the link encoded (every engine's own all-to-all and
all-gather), with error feedback; with overlap the exchange runs behind the next steps. Every engine ends with
DDP's model (bit-identical on this machine; TOL allows DeepSpeed's fp32 masters to round differently); a run
killed and resumed from a checkpoint taken mid-cycle, with fragments at different points of their period, ends
bit-identical to the uninterrupted one (DDP with int8, its per-rank error feedback and an exchange in flight at
the checkpoint, started again on resume; DeepSpeed ZeRO-2, whose state goes by name through DeepSpeed's own
assembly). A fragment count larger than the model's tensors is one line for the job. The closed forms of the
schedule, the outer step, the codecs, the error feedback and the overlap: tests/test_averaging.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import distkit, final_params, max_abs_diff, ok, summary

TOL = 1e-5
OUTER = "'outer_optimizer': {'class': 'nesterov', 'lr': 0.7, 'momentum': 0.9}"
# H = 8, F = 3: fragments at offsets 0, 2, 5; the checkpoint at step 10 falls mid-period for each of them
PARAM = {
    "fragments": f"'reduce_type': 'param', 'param_sync_step': 8, 'param_sync_fragments': 3, {OUTER}",
    # all three: fragments, int8, each exchange overlapped with the next 2 steps (in flight at the checkpoint)
    "streaming": f"'reduce_type': 'param', 'param_sync_step': 8, 'param_sync_fragments': 3, {OUTER}, "
                 "'param_sync_compression': 'int8', 'param_sync_overlap': 2",
}
ENGINES = {
    "ddp": "'backend': 'ddp'",
    "mpi": "'backend': 'mpi'",
    "horovod": "'backend': 'horovod', 'require_horovod': True",
    "zero2": "'backend': 'deepspeed', 'deepspeed_config': {'zero_optimization': {'stage': 2}}",
    "zero3": "'backend': 'deepspeed', 'deepspeed_config': {'zero_optimization': {'stage': 3, "
             "'stage3_param_persistence_threshold': 0}}",
}
COMMON = ["++max_steps", "24", "++progress_bar", "False", "++log_every", "4", "++checkpoint_every", "10",
          "++optimizer", "{'class': 'sgd', 'momentum': 0.9}"]


def _args(out: Path, engine: str, variant: str) -> list[str]:
    return ["train", "configs/returnn_ddp.py", "--nprocs", "2", "++output_dir", str(out), *COMMON,
            "++distributed", "{" + ENGINES[engine] + ", " + PARAM[variant] + "}"]


def _train(out: Path, engine: str, variant: str) -> Path:
    ok(distkit(*_args(out, engine, variant), timeout=300))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    base = tmp_path_factory.mktemp("fragments")
    return {("ddp", v): _train(base / f"ddp-{v}", "ddp", v) for v in PARAM}


# streaming on every engine (each engine's own all-to-all and all-gather, started in the background; ZeRO-2's and
# ZeRO-3's per-parameter master views); the blocking uncompressed fragments where an engine has code of its own
# for them (DeepSpeed's masters' average; the other engines average a fragment with the all-reduce they average
# the whole model with)
@pytest.mark.parametrize("engine,variant", [("mpi", "streaming"), ("horovod", "streaming"), ("zero2", "streaming"),
                                            ("zero3", "streaming"), ("zero2", "fragments")])
def test_every_engine_ends_with_ddps_model(runs: dict[tuple[str, str], Path], engine: str, variant: str,
                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    out = runs[engine, variant] = _train(tmp_path_factory.mktemp(engine) / "run", engine, variant)
    s = summary(out)
    assert s["ranks_in_sync"] is True and s["reduce_type"] == "param"
    assert max_abs_diff(final_params(out), final_params(runs["ddp", variant])) <= TOL
    if variant == "streaming":  # it really changed the result (it is not the blocking fp32 exchange)
        assert max_abs_diff(final_params(out), final_params(runs["ddp", "fragments"])) > 1e-6


@pytest.mark.parametrize("engine,variant", [("ddp", "streaming"), ("zero2", "fragments")])
def test_a_checkpoint_mid_cycle_resumes_bit_identical(runs: dict[tuple[str, str], Path], engine: str, variant: str,
                                                      tmp_path: Path) -> None:
    ref = runs.get((engine, variant)) or _train(tmp_path / "ref", engine, variant)
    out = tmp_path / "killed"
    killed = distkit(*_args(out, engine, variant), DISTKIT_FAULT="1:13:kill", timeout=300)
    said = f"exit {killed.returncode}\n{killed.stderr[-3000:]}"
    assert killed.returncode != 0 and "rank 1 failed (killed by SIGKILL)" in killed.stderr, said
    assert (out / "checkpoints" / "latest").read_text() == "step-0000010", said
    ok(distkit(*_args(out, engine, variant), "++resume", "auto", timeout=300))
    a, b = final_params(ref), final_params(out)
    assert all(a[k].equal(b[k]) for k in a), {k: (a[k] - b[k]).abs().max().item() for k in a}
    assert summary(out)["param_checksum"] == summary(ref)["param_checksum"]


def test_more_fragments_than_tensors_is_one_line_for_the_job(tmp_path: Path) -> None:
    # the digits MLP averages 6 tensors (3 weights, 3 biases)
    res = distkit("train", "configs/returnn_ddp.py", "--nprocs", "2", "++output_dir", str(tmp_path / "out"),
                  "++progress_bar", "False", "++distributed",
                  "{'reduce_type': 'param', 'param_sync_step': 8, 'param_sync_fragments': 7}")
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [ln for ln in res.stderr.splitlines() if "error" in ln.lower()]
    assert errors == ["distkit: error: 'distributed.param_sync_fragments' (7) is more than the 6 tensors the model "
                      "averages: set it to at most 6"], res.stderr[-3000:]
