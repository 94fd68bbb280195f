"""The command itself: help texts, console script, uneven data."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import BIN, ROOT, distkit, ok, run, summary

FLAGS = ["--nprocs", "--local_rank", "--local-rank", "--distributed_backend", "--distributed_launch",
         "--find_unused_parameters", "--deepspeed", "--deepspeed_config"]


def test_help_documents_every_flag() -> None:
    top = ok(distkit("--help"))
    assert "train" in top.stdout
    train = ok(distkit("train", "--help"))
    for flag in FLAGS:
        assert flag in train.stdout, flag
    assert "++key value" in train.stdout


def test_console_script_equals_module(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["train", "configs/returnn_ddp.py", "++max_steps", "3", "++progress_bar", "False"]
    ok(run([str(BIN / "distkit"), *common, "++output_dir", str(a)]))
    ok(distkit(*common, "++output_dir", str(b)))
    assert summary(a)["param_checksum"] == summary(b)["param_checksum"]


UNEVEN = '''
import os
import torch
from torch.utils.data import TensorDataset
from distkit.tasks.digits import make_model

model = make_model
def dataset():
    # every rank holds a different amount of data (e.g. files split unevenly)
    n = 100 + 37 * int(os.environ.get("RANK", "0"))
    g = torch.Generator().manual_seed(n)
    return TensorDataset(torch.rand(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
torch_distributed = {}
batch_size = 10
num_epochs = 2
progress_bar = False
'''


@pytest.mark.parametrize("mode,steps", [("shard", 10), ("random_seed_offset", 20)])
def test_uneven_data_per_rank_never_hangs(tmp_path: Path, mode: str, steps: int) -> None:
    cfg = tmp_path / "uneven.py"
    cfg.write_text(UNEVEN + f"output_dir = {str(tmp_path / 'out')!r}\ndata_distribution = {mode!r}\n")
    ok(distkit("train", str(cfg), "--nprocs", "2", timeout=120))
    s = summary(tmp_path / "out")
    # rank 0 has 100 samples, rank 1 137. shard: global batches of 20 -> min(5, 6) = 5 steps per
    # epoch; random_seed_offset: batches of 10 from each rank's own data -> min(10, 13) = 10.
    assert s["steps"] == steps and s["ranks_in_sync"] and "eval_accuracy" not in s  # a custom task: no metrics asked


def test_keys_lists_every_key_with_its_meaning() -> None:
    from distkit.config.schema import ALIAS_KEYS, DISTRIBUTED_KEYS, TOP_LEVEL_KEYS, key_docs

    docs = {k: m for k, _, m in key_docs()}
    listed = ok(distkit("keys")).stdout
    for key in [k for k in TOP_LEVEL_KEYS if k != "distributed"] + [f"distributed.{k}" for k in DISTRIBUTED_KEYS]:
        assert docs[key], f"key {key} has no #: comment in distkit/config/schema.py"
        assert f"\n{key} " in "\n" + listed, key
    assert all(a in listed for a in ALIAS_KEYS)
    one = ok(distkit("keys", "lr_sched")).stdout
    assert one.startswith("lr_scheduler") and "warmup_steps" in one and "learning_rate" not in one
    assert "distkit keys" in ok(distkit("train", "--help")).stdout
    bad = distkit("keys", "no_such_key")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("distkit: error: no config key contains")


def test_docs_config_md_is_the_generated_key_table() -> None:
    from distkit.config.schema import keys_markdown

    expected = keys_markdown()
    assert ok(distkit("keys", "--markdown")).stdout == expected
    assert "| key | default | meaning |" in expected and "\n- `torch_distributed`" in expected
    doc = ROOT / "docs" / "config.md"
    assert doc.read_text() == expected, (
        "docs/config.md differs from `distkit keys --markdown` (distkit/config/schema.py changed?): regenerate it with "
        "`.venv/bin/python -m distkit keys --markdown > docs/config.md`")


def _imports(cmd: list[str], tmp_path: Path, status: int = 0) -> tuple[set[str], str]:
    """The modules ``cmd`` (a Python command line, which must exit with ``status``) imported, and its stdout. The
    list is ``-X importtime``'s on stderr, asked for by its variable: the lighthouse reads the process's argv,
    where ``-X`` would stand."""
    res = run([str(BIN / "python"), *cmd], cwd=tmp_path, PYTHONPROFILEIMPORTTIME="1")
    assert res.returncode == status, res.stderr[-3000:]
    return {line.split("|")[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}, res.stdout


def test_commands_that_do_not_train_do_not_import_torch(tmp_path: Path) -> None:
    # what the package root, the parser and the lighthouse import lazily (distkit/__init__.py, cli.build_parser,
    # distkit/ft/lighthouse.py): a refused config, `distkit keys` and the lighthouse start without torch
    refused, _ = _imports(["-m", "distkit", "train", str(ROOT / "configs" / "demo.py"), "++nosuchkey", "1",
                        "++output_dir", str(tmp_path / "out")], tmp_path, status=2)
    assert "distkit.config" in refused and "torch" not in refused
    assert not (tmp_path / "out").exists()
    keys, _ = _imports(["-m", "distkit", "keys", "param_sync_step"], tmp_path)
    assert "distkit.config.schema" in keys and "torch" not in keys
    lighthouse, usage = _imports([str(ROOT / "distkit" / "ft" / "lighthouse.py"), "--help"], tmp_path)
    assert "--min_replicas" in usage and "torch" not in lighthouse  # torchft's own lighthouse answered
    # and the training API is still there, imported on first use
    res = ok(run([str(BIN / "python"), "-c", "import sys, distkit; assert 'torch' not in sys.modules; "
                  "from distkit import Session, Trainer, run_on_main; print(Session.__module__, 'torch' in sys.modules)"]))
    assert res.stdout.split() == ["distkit.session", "True"]
