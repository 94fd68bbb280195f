"""Config: files, overrides, precedence, seed spellings, resolved output."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distkit.config import LaunchFlags, load_config, split_overrides
from distkit.errors import ConfigError


def _py(tmp_path: Path, text: str, name: str = "c.py") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_precedence_defaults_files_command_line(tmp_path: Path) -> None:
    a = _py(tmp_path, "batch_size = 4\nlearning_rate = 0.5\n", "a.py")
    b = tmp_path / "b.yaml"
    b.write_text("batch_size: 8\nnum_epochs: 2\n")
    cfg = load_config([a, str(b)], [("num_epochs", 3)])
    assert (cfg.batch_size, cfg.learning_rate, cfg.num_epochs, cfg.seed) == (8, 0.5, 3, 42)


def test_override_parsing_literal_else_string() -> None:
    rest, pairs = split_overrides(["train", "c.py", "++lr", "0.1", "++name", "abc", "++d={'a': 1}", "--nprocs", "2"])
    assert rest == ["train", "c.py", "--nprocs", "2"]
    assert pairs == [("lr", 0.1), ("name", "abc"), ("d", {"a": 1})]


def test_python_config_callables_and_helpers(tmp_path: Path) -> None:
    cfg = load_config([_py(tmp_path, (
        "import torch\n"
        "def _private(): pass\n"
        "def helper():\n    return 1\n"
        "def build():\n    return torch.nn.Linear(64, 10)\n"
        "model = build\n"
        "torch_distributed = {'reduce_type': 'param', 'param_sync_step': 7, 'timeout_sec': 60, 'backend': 'cpu:gloo,cuda:nccl'}\n"
    ))])
    assert cfg.model is not None and cfg.model().out_features == 10
    d = cfg.distributed
    assert (d.backend, d.reduce_type, d.param_sync_step, d.timeout_s, d.pg_backend) == ("ddp", "param", 7, 60, None)


def test_module_function_strings_are_imported(tmp_path: Path) -> None:
    cfg = load_config([], [("model", "distkit.tasks.digits:make_model"), ("loss", "distkit.tasks:cross_entropy")])
    from distkit.tasks import cross_entropy
    from distkit.tasks.digits import make_model

    assert cfg.model is make_model and cfg.loss is cross_entropy


def test_a_callback_named_by_a_string_is_imported_and_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``callbacks = ['module:Class']``: the class imported and instantiated before start (it was kept as a string,
    and the trainer never called it); an instance in the list is kept as it is."""
    (tmp_path / "my_callbacks.py").write_text("class Printer:\n    def on_step_end(self, trainer, metrics):\n"
                                              "        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config([], [("callbacks", ["my_callbacks:Printer"])])
    import my_callbacks

    assert len(cfg.callbacks) == 1 and isinstance(cfg.callbacks[0], my_callbacks.Printer)
    instance = my_callbacks.Printer()
    assert load_config([], [("callbacks", [instance])]).callbacks == [instance]


def test_seed_spellings(tmp_path: Path) -> None:
    # perceptrain: nprocs, backend (torch.distributed), compute_setup
    cfg = load_config([_py(tmp_path, "nprocs = 2\nbackend = 'gloo'\ncompute_setup = 'cpu'\n")])
    assert (cfg.nprocs, cfg.distributed.pg_backend, cfg.device) == (2, "gloo", "cpu")
    # SpeechBrain flags
    cfg = load_config([], [], LaunchFlags(distributed_backend="gloo", find_unused_parameters=True, nprocs=3))
    assert cfg.distributed.pg_backend == "gloo" and cfg.distributed.options == {"find_unused_parameters": True}
    assert cfg.nprocs == 3
    # RETURNN grad options go to DDP
    cfg = load_config([_py(tmp_path, "torch_distributed = {'options': {'bucket_cap_mb': 5}}\n")])
    assert cfg.distributed.reduce_type == "grad" and cfg.distributed.options == {"bucket_cap_mb": 5}
    # nested override
    cfg = load_config([], [("distributed.reduce_type", "param"), ("param_outer_optimizer", {"class": "nesterov", "lr": 0.7})])
    assert cfg.distributed.reduce_type == "param" and cfg.distributed.outer_optimizer == {"class": "nesterov", "lr": 0.7}


def test_helper_function_that_looks_like_a_typo_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean 'model'"):
        load_config([_py(tmp_path, "def modle():\n    pass\n")])


def test_resolved_config_written_by_rank0(tmp_path: Path) -> None:
    from conftest import distkit, ok

    out = tmp_path / "o"
    ok(distkit("train", "configs/returnn_ddp.py", "++max_steps", "2", "++output_dir", str(out), "++progress_bar", "False",
               "++loss", "distkit.tasks:cross_entropy"))
    resolved = json.loads((out / "config.resolved.json").read_text())
    assert resolved["distributed"]["backend"] == "ddp" and resolved["max_steps"] == 2
    assert resolved["loss"] == "distkit.tasks:cross_entropy" and resolved["world_size"] == 1
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 2 and lines[-1]["samples"] == 32 and lines[-1]["loss"] > 0


def test_imported_names_in_a_python_config_are_not_keys(tmp_path: Path) -> None:
    text = ("from __future__ import annotations\n"  # binds `annotations` (a compiler switch, not a key)
            "import torch\nfrom torch.utils.data import Dataset\nfrom torch.optim import Optimizer\n"
            "from json import loads as dataset_loader\nbatch_size = 4\n")
    assert load_config([_py(tmp_path, text)]).batch_size == 4
    with pytest.raises(ConfigError, match="unknown config key 'Datasett'"):  # a plain value under an unknown name
        load_config([_py(tmp_path, "Datasett = 3\n", "d.py")])
    with pytest.raises(ConfigError, match="did you mean 'dataset'"):  # a function defined here, named like a key
        load_config([_py(tmp_path, "def datset():\n    return None\n", "e.py")])


def test_deepspeed_config_read_as_deepspeed_reads_it(tmp_path: Path) -> None:
    ds = tmp_path / "ds_config.json"  # the LUMI guide's file has a trailing comma; comments too
    ds.write_text('{\n  // ZeRO stage 1\n  "zero_optimization": {"stage": 1},\n  "fp16": {"enabled": false,},\n}\n')
    cfg = load_config([], [], LaunchFlags(deepspeed=True, deepspeed_config=str(ds)))
    assert cfg.distributed.deepspeed_config == {"zero_optimization": {"stage": 1}, "fp16": {"enabled": False}}
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 1}\n')
    with pytest.raises(ConfigError, match="bad.json:.*invalid DeepSpeed config"):
        load_config([], [], LaunchFlags(deepspeed_config=str(bad)))


def test_ranks_outnumbering_a_hosts_gpus_are_one_line_before_start() -> None:
    """Found on a 1-GPU host: ``--nprocs 2`` with device cuda or auto gave rank 1 ``cuda:1`` and a traceback
    ("invalid device ordinal") while rank 0 waited. Every rank, and the launcher before any rank starts, now
    refuses with the line that names the fix. On plain values: no GPU is needed to check the rule."""
    from distkit.components import pick_device, ranks_per_gpu_problem

    assert ranks_per_gpu_problem("cuda", 2, 1) == (
        "2 ranks on this host but 1 visible CUDA device (device 'cuda': one GPU per rank): start 1 rank per host "
        "(--nprocs 1, torchrun --nproc_per_node 1), or set ++device cpu")
    assert ranks_per_gpu_problem("auto", 8, 4) == (
        "8 ranks on this host but 4 visible CUDA devices (device 'auto': one GPU per rank): start 4 ranks per host "
        "(--nprocs 4, torchrun --nproc_per_node 4), or set ++device cpu")
    for fits in (("cuda", 2, 2), ("cuda", 1, 8), ("auto", 4, 0), ("cpu", 4, 1), ("auto", 3, 4)):
        assert ranks_per_gpu_problem(*fits) is None, fits
    assert "no CUDA device is visible" in str(ranks_per_gpu_problem("cuda", 1, 0))
    # this machine has no GPU: auto is the CPU for any number of ranks, cuda is refused on every rank
    assert pick_device("auto", 1, 2) == torch.device("cpu")
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        pick_device("cuda", 1, 2)
