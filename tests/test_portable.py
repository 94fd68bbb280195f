"""Resume anywhere (issue 10, items 1 and 2): a checkpoint written by one engine on N ranks continues on
another engine, on M ranks, in either mode, through its engine-neutral portable part.

Six 2-rank sources (ddp, DeepSpeed ZeRO-3, Horovod, fsdp, mpi, ZeRO-2) train 20 steps of Adam with a checkpoint at step
10; each is the uninterrupted reference. Every resume starts from a source's step 10 with the same
global batch (24) and must end where the uninterrupted run ends: eval loss within 1e-4, every model
tensor within 1e-5. The sources themselves agree bit for bit (grad mode is the same arithmetic on
every engine), which is asserted too."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import ROOT, distkit, ok, summary
from distkit import checkpoint, portable

ARGS = ["train", str(ROOT / "configs" / "returnn_ddp.py"), "++max_steps", "20", "++checkpoint_every", "10",
        "++log_every", "10", "++progress_bar", "False", "++optimizer", "{'class': 'adam'}", "++learning_rate", "0.002"]
GLOBAL_BATCH = 24
ENGINES = {
    "ddp": '{"backend": "ddp"}',
    "mpi": '{"backend": "mpi"}',
    "horovod": '{"backend": "horovod"}',
    "zero2": '{"backend": "deepspeed", "deepspeed_config": {"zero_optimization": {"stage": 2}}}',
    "zero3": '{"backend": "deepspeed", "deepspeed_config": {"zero_optimization": {"stage": 3}}}',
    "fsdp": '{"backend": "fsdp"}',
}


def train(out: Path, engine: str, nprocs: int, *extra: str) -> subprocess.CompletedProcess[str]:
    return distkit(*ARGS, "--nprocs", str(nprocs), "++batch_size", str(GLOBAL_BATCH // nprocs),
                   "++distributed", ENGINES[engine], "++output_dir", str(out), *extra)


def final_model(out: Path) -> dict[str, torch.Tensor]:
    """The model at the end of a run, from the portable part of its last checkpoint."""
    latest = checkpoint.latest(str(out / "checkpoints"))
    assert latest is not None
    return portable.model_state(portable.read(latest))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    out = {}
    for engine in ("ddp", "zero3", "horovod", "fsdp", "mpi", "zero2"):
        out[engine] = root / engine
        ok(train(out[engine], engine, 2))
    return out


def test_sources_agree_and_hold_a_sharded_portable_part(sources: dict[str, Path]) -> None:
    ref = final_model(sources["ddp"])
    for engine in ("zero3", "horovod", "fsdp", "mpi", "zero2"):
        assert max_diff(final_model(sources[engine]), ref) == 0.0, engine
        assert summary(sources[engine])["eval_loss"] == summary(sources["ddp"])["eval_loss"], engine
    ckpt = sources["zero3"] / "checkpoints" / "step-0000010"
    files = sorted(p.name for p in (ckpt / "portable").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its share
    sizes = [(ckpt / "portable" / f).stat().st_size for f in files[1:]]
    assert min(sizes) > 0.3 * max(sizes)  # dealt out by size, not all on one rank
    # grad mode: the rank files hold no replica (no rank gathered the ZeRO-3 model); the portable part is it
    for engine in sources:
        own = torch.load(sources[engine] / "checkpoints" / "step-0000010" / "rank-00001.pt", weights_only=False)
        assert own["model"] is None and own["optimizer"] is None, engine
    entries = portable.read(str(ckpt))
    names = {n for n, _ in torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                                               torch.nn.ReLU(), torch.nn.Linear(64, 10)).named_parameters()}
    # optimizer state by parameter name, whole (ZeRO-3 partitions assembled), with Adam's step
    assert {k for k in entries if k.startswith("optim/")} == {f"optim/{n}/{s}" for n in names
                                                             for s in ("exp_avg", "exp_avg_sq", "step")}
    assert entries["optim/0.weight/exp_avg"].shape == (128, 64) and float(entries["optim/0.weight/step"]) == 10
    meta = entries[portable.META]
    assert meta["progress"] == {"step": 10, "samples": 10 * GLOBAL_BATCH, "global_batch": GLOBAL_BATCH}
    assert meta["engine"] == "deepspeed" and meta["world_size"] == 2
    # fsdp (FSDP2's DTensor shards) writes the same portable part: optimizer state whole and by name, as ddp's
    a = portable.read(str(sources["fsdp"] / "checkpoints" / "step-0000020"))
    b = portable.read(str(sources["ddp"] / "checkpoints" / "step-0000020"))
    optim = sorted(k for k in b if k.startswith("optim/"))
    assert optim and sorted(k for k in a if k.startswith("optim/")) == optim
    assert max(float((a[k].float() - b[k].float()).abs().max()) for k in optim) == 0.0
    assert a[portable.META]["engine"] == "fsdp" and a[portable.META]["world_size"] == 2


CASES = [  # (source engine, target engine, target ranks)
    ("zero3", "ddp", 2),
    ("horovod", "ddp", 2),
    ("ddp", "ddp", 1),
    ("ddp", "ddp", 3),
    # fsdp writes it (DTensor shards) and reads it, from and to the other sharded engine too (issue 38 item 6)
    ("fsdp", "ddp", 2),
    ("fsdp", "zero3", 2),
    ("fsdp", "horovod", 2),
    ("fsdp", "mpi", 2),
    ("fsdp", "zero2", 2),
    ("zero3", "fsdp", 2),
    ("horovod", "fsdp", 2),
    ("mpi", "fsdp", 2),
    ("zero2", "fsdp", 2),
    ("ddp", "fsdp", 3),
]


@pytest.mark.parametrize("source,target,nprocs", CASES, ids=[f"{s}-to-{t}-{n}ranks" for s, t, n in CASES])
def test_resume_on_another_engine_or_world_size_ends_where_the_uninterrupted_run_ends(
        sources: dict[str, Path], tmp_path: Path, source: str, target: str, nprocs: int) -> None:
    ckpt = sources[source] / "checkpoints" / "step-0000010"
    out = tmp_path / "resumed"
    res = ok(train(out, target, nprocs, "++resume", str(ckpt)))
    assert "loaded its portable part into" in res.stdout and f"on {nprocs} rank" in res.stdout
    assert "resumed from" in res.stdout and "at step 10" in res.stdout
    got, want = summary(out), summary(sources[source])
    assert got["steps"] == 20 and got["samples"] == 20 * GLOBAL_BATCH and got["ranks_in_sync"]
    assert abs(got["eval_loss"] - want["eval_loss"]) < 1e-4
    assert max_diff(final_model(out), final_model(sources[source])) < 1e-5


def test_grad_checkpoint_continues_in_param_mode(sources: dict[str, Path], tmp_path: Path) -> None:
    """grad -> param (fsdp's sharded checkpoint, into fsdp in param mode: one rank per replica group): every rank
    starts from the checkpoint's replica; the averager begins a new period."""
    out = tmp_path / "param"
    res = ok(train(out, "fsdp", 2, "++resume", str(sources["fsdp"] / "checkpoints" / "step-0000010"),
                   "++distributed.reduce_type", "param", "++distributed.param_sync_step", "5"))
    assert "in grad mode; loaded its portable part into fsdp on 2 ranks in param mode" in res.stdout
    got = summary(out)
    assert got["steps"] == 20 and got["ranks_in_sync"] and got["reduce_type"] == "param"
    # 10 more steps from the same start: close to, but not the same as, grad mode (local Adam steps)
    assert 0 < max_diff(final_model(out), final_model(sources["fsdp"])) < 0.05


def test_param_mode_continues_its_period_and_outer_momentum_on_another_engine(tmp_path: Path) -> None:
    """param -> param on another engine: the averager's state (steps since the sync, DiLoCo's anchor and
    outer momentum) travels by name in the portable part, written by ZeRO-2 (flat master partitions,
    assembled by DeepSpeed) and read by the mpi engine (plain tensors) and by ZeRO-3 (partitions again).
    With SGD (no per-rank optimizer state) and a checkpoint at a sync, where the ranks agree, the resumed
    runs end exactly where the uninterrupted one ends (measured: bit-identical); clearing the momentum,
    as a new period would, moves the result."""
    param = ("'reduce_type': 'param', 'param_sync_step': 5, "
             "'outer_optimizer': {'class': 'nesterov', 'lr': 0.7, 'momentum': 0.9}")
    engines = {"zero2": "'backend': 'deepspeed', 'deepspeed_config': {'zero_optimization': {'stage': 2}}",
               "mpi": "'backend': 'mpi'",
               "zero3": "'backend': 'deepspeed', 'deepspeed_config': {'zero_optimization': {'stage': 3}}"}

    def run(engine: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        return distkit(*ARGS, "--nprocs", "2", "++batch_size", "12", "++optimizer", "{'class': 'sgd'}",
                       "++learning_rate", "0.05", "++distributed", "{" + engines[engine] + ", " + param + "}",
                       "++output_dir", str(out), *extra)

    ok(run("zero2", tmp_path / "source"))
    entries = portable.read(str(tmp_path / "source" / "checkpoints" / "step-0000010"))
    assert entries[portable.META]["averager"] == {"steps_since_sync": 0, "num_syncs": 2, "outer": True, "steps": 10,
                                                  "fragment_since": [0], "next_fragment": 0}
    averager = portable.averager_state(entries)
    assert averager.keys() == {f"{k}/{n}" for k in ("anchor", "momentum") for n in portable.model_state(entries)}
    assert averager["anchor/0.weight"].shape == (128, 64) and float(averager["momentum/0.weight"].abs().sum()) > 0
    want = final_model(tmp_path / "source")
    for engine in ("mpi", "zero3"):
        res = ok(run(engine, tmp_path / engine, "++resume", str(tmp_path / "source" / "checkpoints" / "step-0000010")))
        assert "written by deepspeed ZeRO-2 on 2 ranks in param mode; loaded its portable part" in res.stdout
        got = summary(tmp_path / engine)
        assert got["steps"] == 20 and got["ranks_in_sync"], engine
        last = portable.read_meta(str(tmp_path / engine / "checkpoints" / "step-0000020"))["averager"]
        assert last["num_syncs"] == 4 and last["steps_since_sync"] == 0, engine  # the count went on from 2
        assert max_diff(final_model(tmp_path / engine), want) < 1e-6, engine


def test_global_batch_change_continues_at_the_same_sample(sources: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "smaller"
    res = ok(distkit(*ARGS, "--nprocs", "2", "++batch_size", "6", "++output_dir", str(out),
                     "++resume", str(sources["ddp"] / "checkpoints" / "step-0000010")))
    assert ("distkit: the global batch changes from 24 to 12 samples per step; the data continues at global sample "
            "240 (epoch 1), the step count at 10") in res.stdout
    assert summary(out)["samples"] == 10 * 24 + 10 * 12


def test_export_and_convert_from_any_engine(sources: dict[str, Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`distkit export` to torch.save and safetensors, `distkit inspect`, `distkit convert` to one file and back:
    the same tensors from the ZeRO-3, Horovod and fsdp runs as from the ddp run, and the converted checkpoint
    is complete and verified."""
    from safetensors.torch import load_file

    from distkit.commands.cli import main

    want = final_model(sources["ddp"])
    assert main(["export", str(sources["zero3"]), str(tmp_path / "m.pt")]) == 0
    assert main(["export", str(sources["horovod"]), str(tmp_path / "m.safetensors")]) == 0
    assert main(["export", str(sources["fsdp"]), str(tmp_path / "fsdp.safetensors")]) == 0
    for got in (torch.load(tmp_path / "m.pt", weights_only=True), load_file(tmp_path / "m.safetensors"),
                load_file(tmp_path / "fsdp.safetensors")):
        assert max_diff(got, want) == 0.0
    capsys.readouterr()  # export's lines
    assert main(["inspect", str(sources["fsdp"]), "--json"]) == 0  # fsdp's checkpoint: whole, by name, intact
    info = json.loads(capsys.readouterr().out)
    assert (info["engine"], info["step"], info["world_size"], info["intact"], info["portable"]) == \
        ("fsdp", 20, 2, True, True)
    assert info["tensors"] == len(want) and info["elements"] == sum(t.numel() for t in want.values())
    ckpt = sources["zero3"] / "checkpoints" / "step-0000010"
    assert main(["convert", str(ckpt), str(tmp_path / "state.pt")]) == 0
    assert main(["convert", str(tmp_path / "state.pt"), str(tmp_path / "back")]) == 0
    assert main(["convert", str(tmp_path / "state.pt"), str(tmp_path / "back")]) == 2  # overwrites nothing
    assert checkpoint.verify(str(tmp_path / "back")) is None
    a, b = portable.read(str(ckpt)), portable.read(str(tmp_path / "back"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a if k != portable.META)
    assert b[portable.META]["progress"] == a[portable.META]["progress"]
