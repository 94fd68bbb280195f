"""Every example config runs as docs/running.md documents it (shortened with ++max_steps)."""
from __future__ import annotations

from pathlib import Path

from conftest import BIN, distkit, ok, run, summary

QUICK = ["++progress_bar", "False", "++max_steps", "12"]


def test_demo_reaches_90_percent(tmp_path: Path) -> None:
    res = ok(distkit("train", "configs/demo.py", "--nprocs", "2", "++output_dir", str(tmp_path), timeout=240))
    s = summary(tmp_path)
    assert s["eval_accuracy"] >= 0.90 and s["world_size"] == 2 and s["ranks_in_sync"]
    assert "eval_accuracy" in res.stdout and "computing time" in res.stdout + res.stderr


def test_returnn_param_config(tmp_path: Path) -> None:
    ok(distkit("train", "configs/returnn_param.py", "--nprocs", "2", "++output_dir", str(tmp_path), *QUICK))
    s = summary(tmp_path)
    assert (s["reduce_type"], s["param_sync_step"], s["ranks_in_sync"], s["steps"]) == ("param", 100, True, 12)


def test_speechbrain_yaml_under_torchrun(tmp_path: Path) -> None:
    ok(run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
            "-m", "distkit", "train", "configs/speechbrain.yaml", "--distributed_launch", "--distributed_backend", "gloo",
            "++output_dir", str(tmp_path), *QUICK]))
    s = summary(tmp_path)
    assert (s["launcher"], s["world_size"], s["backend_impl"].endswith("DDP (gloo)")) == ("torchrun", 2, True)


def test_charlm_json_spawns_from_nprocs_key(tmp_path: Path) -> None:
    ok(distkit("train", "configs/charlm.json", "++output_dir", str(tmp_path), "++max_steps", "6", "++eval_every", "3",
               "++progress_bar", "False"))
    s = summary(tmp_path)
    assert s["world_size"] == 2 and s["launcher"] == "spawn" and s["steps"] == 6
    assert 0 < s["eval_loss"] < 5.0 and s["eval_accuracy"] is not None
    evals = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert len(evals) == 2


def test_mpi_engine_config_under_mpirun(tmp_path: Path) -> None:
    ok(run([str(BIN / "mpirun"), "-np", "2", "--oversubscribe", "--bind-to", "none", str(BIN / "python"), "-m",
            "distkit", "train", "configs/mpi_engine.py", "++output_dir", str(tmp_path), *QUICK]))
    s = summary(tmp_path)
    assert (s["backend"], s["launcher"], s["world_size"], s["ranks_in_sync"]) == ("mpi", "openmpi", 2, True)
    assert s["backend_impl"].startswith("mpi4py")


def test_deepspeed_digits_config_with_zero2_json(tmp_path: Path) -> None:
    ok(distkit("train", "configs/deepspeed_digits.py", "--nprocs", "2", "--deepspeed", "--deepspeed_config",
               "configs/ds_zero2.json", "++output_dir", str(tmp_path), *QUICK, timeout=300))
    s = summary(tmp_path)
    assert (s["backend"], s["zero_stage"], s["world_size"], s["steps"]) == ("deepspeed", 2, 2, 12)
    assert (tmp_path / "deepspeed_config.resolved.json").exists()


SPEECHBRAIN_SCRIPT = '''
import argparse
import speechbrain  # noqa: F401 - its lazy modules (k2_fsa) raise ImportError when an attribute of theirs is read
import torch
import distkit
parser = argparse.ArgumentParser()
distkit.add_arguments(parser)
dk = distkit.init(parser.parse_args())
net = torch.nn.Linear(2, 1, bias=False)
torch.nn.init.zeros_(net.weight)
model, opt = dk.setup(net, torch.optim.SGD(net.parameters(), lr=0.5))
x = torch.full((1, 2), float(dk.rank + 1))
dk.backward(model(x).sum())   # d/dw = x: the mean over the ranks is (1.5, 1.5)
dk.step()
dk.print("weight", dk.unwrap(model).weight.tolist(), "ranks", dk.world_size, dk.env.launcher)
dk.finish()
'''


def test_a_script_that_imports_speechbrain_starts_its_ranks_with_nprocs(tmp_path: Path) -> None:
    """Issue 57 H: the spawner read every loaded module's ``__file__``, which a SpeechBrain LazyModule answers by
    importing its target (k2_fsa: ImportError), so --nprocs failed in any process that had imported speechbrain."""
    script = tmp_path / "sb_script.py"
    script.write_text(SPEECHBRAIN_SCRIPT)
    res = ok(run([str(BIN / "python"), str(script), "--nprocs", "2", "++output_dir", str(tmp_path / "out"),
                  "++progress_bar", "False"], timeout=240))
    assert "weight [[-0.75, -0.75]] ranks 2 spawn" in res.stdout, res.stdout
