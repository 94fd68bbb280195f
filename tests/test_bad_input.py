"""Bad input (DESIGN.md section 7): one line on stderr naming problem and fix, exit 2,
no traceback, nothing written under output_dir."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import distkit
from distkit.cli import main

# (id, config file text or None, extra CLI args, words the one line must contain)
CASES = [
    ("unknown_key", "task = 'digits'\nfoo = 1\n", [], ["unknown config key 'foo'"]),
    ("misspelt_key", "lerning_rate = 0.1\n", [], ["'lerning_rate'", "did you mean 'learning_rate'",
                                                 "If it is a helper, its name must start with '_' (_lerning_rate)"]),
    ("misspelt_override", "", ["++lerning_rate", "0.1"], ["'lerning_rate'", "did you mean 'learning_rate'"]),
    ("bad_reduce_type", "torch_distributed = {'reduce_type': 'params'}\n", [], ["reduce_type", "grad, param", "did you mean 'param'"]),
    ("sync_step_zero", "torch_distributed = {'reduce_type': 'param', 'param_sync_step': 0}\n", [], ["param_sync_step", ">= 1"]),
    ("sync_step_negative", "", ["++distributed.param_sync_step", "-3"], ["param_sync_step", ">= 1", "-3"]),
    ("two_backends", "", ["++torch_distributed", "{}", "++use_horovod", "1"], ["two backends", "torch_distributed", "use_horovod"]),
    ("two_backends_cli", "torch_distributed = {}\n", ["--deepspeed", "++use_horovod", "1"],
     ["two backends", "use_horovod", "deepspeed"]),
    ("two_backends_same_file", "torch_distributed = {}\nuse_horovod = True\n", ["--nprocs", "1"], ["two backends"]),
    ("deepspeed_flag_without_config", "", ["--deepspeed"], ["--deepspeed needs a DeepSpeed config", "--deepspeed_config"]),
    ("nprocs_abbreviated", "", ["--nproc", "2"], ["unrecognized arguments: --nproc"]),
    ("syntax_error", "task = 'digits'\nbatch_size = = 3\n", [], [":3:", "syntax error"]),
    ("exec_error", "task = 'digits'\nx = undefined_name + 1\n", [], [":3:", "NameError", "undefined_name"]),
    ("unknown_task", "task = 'mnist'\n", [], ["'task'", "digits", "charlm"]),
    ("unknown_corpus", "task = 'charlm'\ncharlm_corpus = 'wiki'\n", [], ["'charlm_corpus'", "pydoc, stdlib"]),
    ("batch_size_zero", "batch_size = 0\n", [], ["batch_size", ">= 1"]),
    ("nprocs_zero", "", ["--nprocs", "0"], ["nprocs", ">= 1"]),
    ("nprocs_not_int", "", ["--nprocs", "two"], ["--nprocs", "invalid int value"]),
    ("model_no_import", "model = 'no_such_module_xyz:build'\ndataset = 'no_such_module_xyz:data'\n", [], ["cannot import module 'no_such_module_xyz'"]),
    ("model_no_attr", "model = 'json:no_such_fn'\ndataset = 'json:loads'\n", [], ["has no attribute 'no_such_fn'"]),
    ("bad_device", "device = 'tpu'\n", [], ["'device'", "auto, cpu, cuda"]),
    ("cuda_missing", "compute_setup = 'gpu'\n", [], ["no CUDA device", "auto"]),
    ("options_in_param", "torch_distributed = {'reduce_type': 'param', 'options': {'bucket_cap_mb': 1}}\n", [], ["options", "only apply to reduce_type 'grad'"]),
    ("unknown_distributed_key", "", ["++distributed.bakend", "ddp"], ["'bakend'", "did you mean 'backend'"]),
    ("unknown_torch_distributed_key", "torch_distributed = {'reduce_typ': 'grad'}\n", [], ["torch_distributed", "did you mean 'reduce_type'"]),
    ("bad_optimizer", "optimizer = {'class': 'adamx'}\n", [], ["optimizer class 'adamx'", "Adamax", "RMSprop"]),
    ("optimizer_bad_argument", "optimizer = {'class': 'adam', 'momentum': 0.9}\n", [], ["Adam rejected", "momentum"]),
    ("optimizer_lbfgs", "optimizer = 'lbfgs'\n", [], ["LBFGS", "closure"]),
    ("unknown_scheduler", "lr_scheduler = {'class': 'cosin'}\n", [], ["unknown lr_scheduler class 'cosin'", "cosine"]),
    ("scheduler_bad_argument", "lr_scheduler = {'class': 'cosine', 'gamma': 0.5}\n", [], ["'cosine' does not take ['gamma']"]),
    ("scheduler_torch_bad_argument", "lr_scheduler = {'class': 'StepLR'}\n", [], ["StepLR rejected", "step_size"]),
    ("scheduler_negative_warmup", "lr_scheduler = {'class': 'linear', 'warmup_steps': -1}\n", [], ["warmup_steps", ">= 0"]),
    ("scheduler_on_metric", "lr_scheduler = 'ReduceLROnPlateau'\n", [], ["ReduceLROnPlateau", "on_eval_end"]),
    ("bad_precision", "precision = 'bf16'\n", [], ["'precision'", "bf16-mixed"]),
    ("fp16_on_cpu", "precision = '16-mixed'\n", [], ["'16-mixed'", "CUDA", "bf16-mixed"]),
    ("deepspeed_scheduler_conflict", "deepspeed_config = {'scheduler': {'type': 'WarmupLR'}}\nlr_scheduler = 'cosine'\n", [],
     ["'lr_scheduler'", "'scheduler' block"]),
    ("deepspeed_precision_conflict", "deepspeed_config = {'bf16': {'enabled': True}}\nprecision = '32'\n", [],
     ["'precision' = '32'", "enables bf16"]),
    ("callbacks_not_a_list", "callbacks = 3\n", [], ["'callbacks'", "list"]),
    ("pg_backend_mpi", "", ["--distributed_backend", "mpi"], ["'mpi' backend is not built", "gloo"]),
    ("resume_missing_dir", "resume = '/nonexistent/ckpt'\n", [], ["'resume'", "existing checkpoint directory"]),
    ("deepspeed_batch_conflict", "batch_size = 8\ndeepspeed_config = {'train_micro_batch_size_per_gpu': 4}\n", [],
     ["batch_size", "train_micro_batch_size_per_gpu"]),
    ("deepspeed_config_missing", "", ["--deepspeed_config", "nope_ds.json"], ["'nope_ds.json' does not exist"]),
    ("bad_compression", "use_horovod = True\nhorovod_compression = 'int8'\n", [], ["compression", "none, fp16"]),
    ("horovod_key_without_horovod", "horovod_reduce_type = 'param'\n", [], ["use_horovod = True"]),
    ("override_without_value", "", ["++learning_rate"], ["has no value"]),
    ("resume_bad_value", "resume = 'latest'\n", [], ["'resume' must be 'auto', 'none' (start fresh)", "'latest'"]),
    ("keep_checkpoints_zero", "keep_checkpoints = 0\n", [], ["'keep_checkpoints' must be an integer >= 1", "0"]),
    ("output_dir_below_a_file", "", ["++output_dir", "/etc/hostname/run"], ["output_dir '/etc/hostname/run' cannot be created",
                                                                           "'/etc/hostname' is a file"]),
]


def _write(tmp_path: Path, text: str | None) -> tuple[Path, Path]:
    out = tmp_path / "out"
    cfg = tmp_path / "cfg.py"
    cfg.write_text(f"output_dir = {str(out)!r}\n" + (text or ""))
    return cfg, out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_in_process(case: tuple[str, str, list[str], list[str]], tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    _, text, extra, words = case
    cfg, out = _write(tmp_path, text)
    code = main(["train", str(cfg), *extra])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("distkit: error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not out.exists()


def test_yaml_and_json_errors_name_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("task: digits\nbatch_size: [1\n")
    j = tmp_path / "c.json"
    j.write_text('{"task": "digits",\n "batch_size": }\n')
    for path, word in ((y, "invalid YAML"), (j, "c.json:2: invalid JSON")):
        assert main(["train", str(path)]) == 2
        line = capsys.readouterr().err.strip()
        assert "\n" not in line and word in line


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("misspelt_key", "syntax_error", "nprocs_zero", "model_no_import")],
                         ids=lambda c: c[0])
def test_bad_input_real_process(case: tuple[str, str, list[str], list[str]], tmp_path: Path) -> None:
    """The same through the real entry point: status 2, one stderr line, no traceback."""
    _, text, extra, words = case
    cfg, out = _write(tmp_path, text)
    res = distkit("train", str(cfg), *extra, timeout=60)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert all(w in res.stderr for w in words)
    assert not out.exists() and res.stdout == ""


def test_a_helper_constant_without_underscore_says_how_to_name_it(tmp_path: Path) -> None:
    """Issue 22: a constant a helper uses (``VOCAB = 65``) is a global like any key; the one line says that
    a helper's name takes a "_" prefix, through the real entry point (status 2, nothing written)."""
    cfg, out = _write(tmp_path, "VOCAB = 65\n\ndef model():\n    import torch\n    return torch.nn.Embedding(VOCAB, 8)\n")
    res = distkit("train", str(cfg), timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        f"distkit: error: unknown config key 'VOCAB' in {cfg}: a helper name in a Python config must start with '_' "
        "(_VOCAB) to be ignored (`distkit keys` lists the keys)"], res.stderr
    assert not out.exists()


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", str(tmp_path / "nope.py")]) == 2
    line = capsys.readouterr().err.strip()
    assert "nope.py' does not exist" in line and "\n" not in line


@pytest.mark.parametrize("exists", [False, True], ids=["new_dir", "existing_dir"])
def test_read_only_output_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str], exists: bool) -> None:
    """A read-only output_dir (a read-only mount: root ignores chmod) is one line and exit 2 before
    training starts, checked by a write probe that leaves nothing behind."""
    import os
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(ro)]).returncode:
        pytest.skip("needs root to mount a read-only tmpfs")
    try:
        out = ro / "run"
        if exists:
            (out / "checkpoints").mkdir(parents=True)
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        cfg, _ = _write(tmp_path, "task = 'digits'\n")
        assert main(["train", str(cfg), "--nprocs", "2", "++output_dir", str(out)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        where = out if exists else ro
        assert lines == [f"distkit: error: output_dir '{out}' is not writable (Read-only file system: '{where}'): "
                         "choose a writable output_dir or fix its permissions"]
        assert sorted(p.name for p in ro.rglob("*")) == (["checkpoints", "run"] if exists else [])
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)
