"""The Python API: distkit.Trainer, run_on_main, is_main_process."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import distkit
from conftest import BIN, ok, run

SCRIPT = '''
import json, os, sys
import distkit

out = sys.argv[1]
marker = os.path.join(out, "prepared.txt")
os.makedirs(out, exist_ok=True)

def prepare():
    import time
    time.sleep(1.0)  # if the others did not wait, they would look before the file exists
    with open(marker, "a") as f:
        f.write(os.environ["RANK"] + "\\n")
    return {"vocab": 42}

seen = []
result = distkit.run_on_main(prepare, post_func=lambda: seen.append(os.path.exists(marker)))
summary = distkit.Trainer({"task": "digits", "torch_distributed": {}, "max_steps": 3, "output_dir": out,
                           "progress_bar": False}).fit()
# one file per rank: lines that two ranks print to a shared stdout can interleave
with open(os.path.join(out, "result-" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump({"rank": int(os.environ["RANK"]), "result": result, "seen": seen,
               "main": distkit.is_main_process(), "in_sync": summary["ranks_in_sync"]}, f)
'''


def test_trainer_python_api_single_process(tmp_path: Path) -> None:
    summary = distkit.Trainer({"task": "digits", "max_steps": 5, "output_dir": str(tmp_path), "progress_bar": False},
                              batch_size=8).fit()
    assert summary["steps"] == 5 and summary["samples"] == 40 and summary["world_size"] == 1
    assert json.loads((tmp_path / "summary.json").read_text())["param_checksum"] == summary["param_checksum"]
    assert distkit.is_main_process()
    assert distkit.run_on_main(lambda x: x * 2, args=[21]) == 42


def test_run_on_main_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    ok(run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", "0", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "localhost:0", str(script), str(tmp_path / "out")], timeout=120))
    rows = [json.loads((tmp_path / "out" / f"result-{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in rows] == [0, 1]
    assert (tmp_path / "out" / "prepared.txt").read_text() == "0\n"  # ran once, on rank 0
    assert all(r["result"] == {"vocab": 42} for r in rows)  # result shared with every rank
    assert rows[1]["seen"] == [True] and rows[0]["seen"] == []  # post_func on the others, after rank 0 finished
    assert [r["main"] for r in rows] == [True, False] and all(r["in_sync"] for r in rows)


def test_max_steps_is_the_run_length_and_epoch_lines_show_their_own_loss(tmp_path: Path,
                                                                          capsys: "pytest.CaptureFixture[str]") -> None:
    # 1437 samples / batch 512 = 2 steps per epoch; max_steps 5 runs 3 epochs (the data repeats)
    summary = distkit.Trainer({"task": "digits", "max_steps": 5, "batch_size": 512, "log_every": 100,
                               "output_dir": str(tmp_path), "progress_bar": False}).fit()
    assert summary["steps"] == 5 and summary["samples"] == 5 * 512
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("epoch ")]
    assert [ln.split(":")[0] for ln in lines] == ["epoch 1", "epoch 2", "epoch 3"]
    assert "2 steps" in lines[0] and "1 steps" in lines[2]
    assert all("train loss nan" not in ln for ln in lines)  # no log point inside an epoch: still its own mean
    losses = [float(ln.split("train loss ")[1].split(",")[0]) for ln in lines]
    assert losses[0] != losses[1]


TRAINER_NPROCS = '''
import json, sys, distkit
s = distkit.Trainer({"task": "digits", "nprocs": 2, "max_steps": 4, "output_dir": sys.argv[1],
                     "progress_bar": False}).fit()
'''


def test_trainer_nprocs_under_plain_python_spawns(tmp_path: Path) -> None:
    script = tmp_path / "fit.py"
    script.write_text(TRAINER_NPROCS)
    ok(run([str(BIN / "python"), str(script), str(tmp_path / "out")], timeout=120))
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (s["world_size"], s["launcher"], s["steps"], s["ranks_in_sync"]) == (2, "spawn", 4, True)
