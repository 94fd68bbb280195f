"""Bad input (DESIGN.md section 7): one line on stderr naming problem and fix, exit 2,
no traceback, nothing written under output_dir."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import distkit, run
from distkit.commands.cli import main

# (id, config file text or None, extra CLI args, words the one line must contain)
CASES = [
    ("unknown_key", "task = 'digits'\nfoo = 1\n", [], ["unknown config key 'foo'"]),
    ("misspelt_key", "lerning_rate = 0.1\n", [], ["'lerning_rate'", "did you mean 'learning_rate'",
                                                 "If it is a helper, its name must start with '_' (_lerning_rate)"]),
    ("misspelt_override", "", ["++lerning_rate", "0.1"], ["'lerning_rate'", "did you mean 'learning_rate'"]),
    ("bad_reduce_type", "torch_distributed = {'reduce_type': 'params'}\n", [], ["reduce_type", "grad, param", "did you mean 'param'"]),
    ("sync_step_zero", "torch_distributed = {'reduce_type': 'param', 'param_sync_step': 0}\n", [], ["param_sync_step", ">= 1"]),
    ("sync_step_negative", "", ["++distributed.param_sync_step", "-3"], ["param_sync_step", ">= 1", "-3"]),
    ("fragments_over_sync_step", "torch_distributed = {'reduce_type': 'param', 'param_sync_step': 4, "
     "'param_sync_fragments': 5}\n", [], ["param_sync_fragments' (5) must be at most param_sync_step (4)"]),
    ("fragments_in_grad_mode", "", ["++distributed.param_sync_fragments", "2"],
     ["param_sync_fragments' only applies to reduce_type 'param'"]),
    ("fragments_zero", "", ["++distributed.param_sync_fragments", "0"], ["param_sync_fragments' must be an integer >= 1"]),
    ("fragments_with_fault_tolerance", "torch_distributed = {'reduce_type': 'param', 'param_sync_fragments': 2}\n"
     "fault_tolerance = {'lighthouse': 'http://127.0.0.1:9', 'replica_id': 0, 'num_replicas': 2}\n", [],
     ["not available with fault_tolerance yet", "set param_sync_fragments = 1"]),
    ("ft_connect_timeout_zero", "torch_distributed = {'reduce_type': 'param'}\n"
     "fault_tolerance = {'lighthouse': 'http://127.0.0.1:9', 'replica_id': 0, 'num_replicas': 2, 'connect_timeout_s': 0}\n",
     [], ["fault_tolerance.connect_timeout_s must be a positive number of seconds, got 0"]),
    ("compression_in_grad_mode", "", ["++distributed.param_sync_compression", "int8"],
     ["param_sync_compression' only applies to reduce_type 'param'"]),
    ("compression_unknown_codec", "torch_distributed = {'reduce_type': 'param', 'param_sync_compression': 'int2'}\n", [],
     ["param_sync_compression' must be one of none, bf16, fp16, int8, int4, e3m0, topk; got 'int2'"]),
    ("topk_density_zero", "torch_distributed = {'reduce_type': 'param', 'param_sync_compression': 'topk', "
     "'param_sync_topk_density': 0}\n", [], ["'distributed.param_sync_topk_density' must be a number in (0, 1], got 0"]),
    ("topk_bits_three", "", ["++distributed.param_sync_topk_bits", "3"],
     ["'distributed.param_sync_topk_bits' must be 2, 4 or 8, got 3"]),
    ("topk_chunk_beyond_int16", "", ["++distributed.param_sync_topk_chunk", "65536"],
     ["'distributed.param_sync_topk_chunk' must be an integer from 1 to 32768, got 65536"]),
    ("compression_with_late_merge", "torch_distributed = {'reduce_type': 'param', 'param_sync_compression': 'int4'}\n"
     "fault_tolerance = {'lighthouse': 'http://127.0.0.1:9', 'replica_id': 0, 'num_replicas': 3, 'late': 'merge'}\n",
     [], ["'distributed.param_sync_compression' is not available with fault_tolerance.late = 'merge'"]),
    ("overlap_not_below_period", "torch_distributed = {'reduce_type': 'param', 'param_sync_step': 8, "
     "'param_sync_fragments': 4, 'param_sync_overlap': 2}\n", [],
     ["param_sync_overlap' (2) must be less than param_sync_step / param_sync_fragments (8 / 4)"]),
    ("overlap_with_time_rule", "torch_distributed = {'reduce_type': 'param', 'param_sync_time_diff': 5.0, "
     "'param_sync_overlap': 1}\n", [], ["param_sync_overlap' needs the step rule"]),
    ("overlap_in_grad_mode", "", ["++distributed.param_sync_overlap", "1"],
     ["param_sync_overlap' only applies to reduce_type 'param'"]),
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
    # a timeout no rank can connect within (was: a traceback from the store), one timedelta cannot hold
    ("timeout_s_tiny", "", ["++distributed.timeout_s", "1e-9"], ["'distributed.timeout_s' must be a number of "
                                                                "seconds from 1 to 1e+07", "got 1e-09"]),
    ("timeout_s_huge", "", ["++distributed.timeout_s", "1e300"], ["'distributed.timeout_s'", "got 1e+300"]),
    ("startup_timeout_s_zero", "", ["++distributed.startup_timeout_s", "0"],
     ["'distributed.startup_timeout_s' must be a number of seconds from 1 to 1e+07", "or None", "got 0"]),
    # a callback named by a string was kept as a string and never called
    ("callback_module_missing", "callbacks = ['no_such_mod:Cb']\n", [],
     ["'callbacks' = 'no_such_mod:Cb': cannot import module 'no_such_mod'"]),
    ("callback_without_hooks", "callbacks = [3]\n", [], ["'callbacks': 3 has none of the hooks on_train_start"]),
    # a seed numpy's generator cannot take (was: a traceback, then AttributeError at exit)
    ("seed_over_32_bits", "seed = 2**70\n", [], ["'seed' must be an integer from 0 to 4294967295",
                                                  "got 1180591620717411303424"]),
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
    # issue 23 item 8: a non-finite number in the config (NaN passes every "> 0" check)
    ("learning_rate_nan_word", "", ["++learning_rate", "nan"], ["'learning_rate' must be a positive, finite number", "'nan'"]),
    ("learning_rate_inf_word", "", ["++learning_rate", "inf"], ["'learning_rate' must be a positive, finite number", "'inf'"]),
    ("learning_rate_nan", "", ["++learning_rate", "NaN"], ["'learning_rate' is nan", "must be finite"]),
    ("learning_rate_overflow", "", ["++learning_rate", "1e999"], ["'learning_rate' is inf", "must be finite"]),
    ("learning_rate_nan_in_file", "learning_rate = float('nan')\n", [], ["'learning_rate' is nan", "must be finite"]),
    ("optimizer_argument_inf", "optimizer = {'class': 'adamw', 'weight_decay': float('inf')}\n", [],
     ["'optimizer.weight_decay' is inf", "must be finite"]),
    ("gradient_clip_nan", "", ["++gradient_clip", "NaN"], ["'gradient_clip' is nan"]),
    # issue 23 item 9: a Python config that ends the process
    ("config_calls_sys_exit", "import sys\nsys.exit(0)\n", [], [":3:", "called sys.exit(0)", "must only define keys"]),
    ("config_calls_exit", "task = 'digits'\nexit()\n", [], [":3:", "called sys.exit()"]),
    # issue 23 item 10: checked against the machine and the launcher before any rank starts
    ("nccl_on_cpu_device", "device = 'cpu'\n", ["++distributed.pg_backend", "nccl"],
     ["pg_backend 'nccl' needs CUDA tensors but device is 'cpu'", "'gloo'"]),
    ("nprocs_beyond_the_machine", "", ["--nprocs", "10000"], ["--nprocs 10000 is more local ranks", "per CPU core"]),
    # issue 62 item 6: silently accepted (a wait cut to timeout_s unseen; a truthy string), or a traceback
    ("ft_connect_timeout_over_timeout_s", "torch_distributed = {'reduce_type': 'param'}\n"
     "fault_tolerance = {'lighthouse': 'http://127.0.0.1:9', 'replica_id': 0, 'num_replicas': 2, 'connect_timeout_s': 600}\n",
     ["++distributed.timeout_s", "300"], ["fault_tolerance.connect_timeout_s (600) is larger than distributed.timeout_s "
                                          "(300)", "set connect_timeout_s to at most 300, or raise distributed.timeout_s"]),
    ("ft_lighthouse_port_out_of_range", "torch_distributed = {'reduce_type': 'param'}\n"
     "fault_tolerance = {'lighthouse': 'http://127.0.0.1:99999', 'replica_id': 0, 'num_replicas': 2}\n", [],
     ["fault_tolerance.lighthouse must be the lighthouse's URL with a port from 1 to 65535", "'http://127.0.0.1:99999'"]),
    ("progress_bar_maybe", "", ["++progress_bar", "maybe"], ["'progress_bar' must be True or False, got 'maybe'"]),
    ("progress_bar_string_in_file", "progress_bar = 'False'\n", [], ["'progress_bar' must be True or False, got 'False'"]),
    ("preemption_two", "preemption = 2\n", [], ["'preemption' must be True or False, got 2"]),
    ("distributed_bool_two", "", ["++distributed.avg_grad", "2"], ["'distributed.avg_grad' must be True or False, got 2"]),
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


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("misspelt_key", "syntax_error", "nprocs_zero", "model_no_import",
                                                                 "learning_rate_nan", "config_calls_sys_exit",
                                                                 "nprocs_beyond_the_machine")],
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


@pytest.mark.parametrize("kind", ["py", "yaml", "json", "deepspeed"])
def test_a_config_file_that_is_not_utf8(kind: str, tmp_path: Path) -> None:
    """Issue 23 item 9: a config saved as Latin-1 is one line naming the file, its line and that it is not
    UTF-8, exit 2 (was a UnicodeDecodeError traceback, exit 1), through the real entry point; the same for
    a DeepSpeed config file."""
    out = tmp_path / "out"
    text = {"py": f"output_dir = {str(out)!r}\n# caf\xe9\n", "yaml": f"output_dir: {out}\n# caf\xe9\n",
            "json": f'{{"output_dir": "{out}",\n "task": "caf\xe9"}}\n',
            "deepspeed": '{"train_micro_batch_size_per_gpu": 8,\n "comment": "caf\xe9"}\n'}[kind]
    cfg = tmp_path / ("ds.json" if kind == "deepspeed" else f"cfg.{kind}")
    cfg.write_bytes(text.encode("latin-1"))
    offset = text.index("\xe9")
    args = [str(_write(tmp_path, "")[0]), "--deepspeed_config", str(cfg)] if kind == "deepspeed" else [str(cfg)]
    res = distkit("train", *args, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [f"distkit: error: {cfg}:2: the config file is not UTF-8 text (byte 0xe9 at offset "
                                       f"{offset}): save it as UTF-8"], res.stderr
    assert not out.exists()


@pytest.mark.parametrize("text", ["", "# nothing here yet\n"], ids=["empty", "only_a_comment"])
def test_an_empty_yaml_config(text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 23 item 9: an empty YAML file (null) is refused, not trained with every default."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    assert main(["train", str(cfg), "++output_dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"distkit: error: config file '{cfg}' is empty (no keys): write the keys in it (`distkit keys` lists them), "
        "or '{}' for the defaults"]
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("spelling", [["++distributed.pg_backend", "nccl"], ["--distributed_backend", "nccl"]],
                         ids=["override", "flag"])
def test_nccl_without_cuda_is_refused_before_start(spelling: list[str], tmp_path: Path) -> None:
    """Issue 23 item 10: pg_backend nccl without a CUDA device is one line and exit 2 before any rank starts
    (was one traceback per rank)."""
    cfg, out = _write(tmp_path, "task = 'digits'\n")
    res = distkit("train", str(cfg), "--nprocs", "2", *spelling, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        "distkit: error: distributed.pg_backend 'nccl' needs a CUDA device but none is visible: use pg_backend 'gloo', "
        "or leave pg_backend unset (nccl on CUDA, gloo on the CPU)"], res.stderr
    assert not out.exists()


def _written(out: Path) -> list[str]:
    """What a run that failed after its ranks started left under ``out``: every file but the run's lock on
    the directory (``.distkit.lock``, taken before the ranks start; it holds no output)."""
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.name != ".distkit.lock") if out.exists() else []


_DATASET = ("def dataset():\n    import torch\n    return torch.utils.data.TensorDataset(torch.zeros(16, 4), "
            "torch.zeros(16, dtype=torch.long))\n")
_MODEL = "def model():\n    import torch\n    return torch.nn.Linear(4, 2)\n"


@pytest.mark.parametrize("key", ["model", "dataset", "train_dataset"])
def test_a_factory_that_raises_is_one_line(key: str, tmp_path: Path) -> None:
    """Issue 23 item 10: a model or dataset factory of the config that raises is one line naming the key,
    the error and where it was raised, exit 2, nothing written (was a traceback, exit 1)."""
    broken = f"def {key}():\n    raise ValueError('width must be even')\n"
    text = {"model": broken + _DATASET, "dataset": _MODEL + broken,
            "train_dataset": _MODEL + broken}[key]
    cfg, out = _write(tmp_path, text)
    res = distkit("train", str(cfg), "++progress_bar", "False", timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    line = text.splitlines().index(f"def {key}():") + 3  # output_dir is line 1; the raise follows the def
    assert res.stderr.splitlines() == [
        f"distkit: error: the '{key}' factory raised ValueError: width must be even (at {cfg}:{line}): "
        "fix the factory in the config"], res.stderr
    assert _written(out) == []


def test_a_diverging_loss_stops_at_the_first_bad_step(tmp_path: Path) -> None:
    """Issue 23 item 8: a learning rate so large that the loss turns nan within a few steps stops the run
    on 2 ranks at the first non-finite loss (was: trained to the end, exit 0, NaN checkpoints): exit 1,
    a line naming the rank and the step, no checkpoint of that step or later (one is written every step)."""
    import re

    cfg, out = _write(tmp_path, "task = 'digits'\nlearning_rate = 1e12\ncheckpoint_every = 1\nprogress_bar = False\n")
    res = distkit("train", str(cfg), "--nprocs", "2", timeout=120)
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    # not anchored to line starts: the two ranks' lines may interleave on the shared stderr
    found = re.findall(r"distkit: rank (\d) failed: NonFiniteLoss: rank \1: the loss is (nan|inf|-inf) at step (\d+): "
                       r"training stopped; no checkpoint of this step or later is written \(lower the learning_rate, set "
                       r"gradient_clip, or check the data and the loss for nan/inf\)", res.stderr)
    assert found, res.stderr
    bad = min(int(step) for _, _, step in found)
    assert 1 < bad < 22  # diverged within a few of the run's 22 steps, after a first finite one
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["latest", *(f"step-{s:07d}" for s in range(1, bad))], (bad, names)
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{bad - 1:07d}"
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize("only_rank_1", [False, True], ids=["every_rank", "rank_1_only"])
def test_a_factory_that_raises_on_two_ranks_is_one_line(only_rank_1: bool, tmp_path: Path) -> None:
    """Issue 23 item 10 with --nprocs 2: the ranks agree on the factory's error and rank 0 alone reports it
    (not a line per rank plus the launcher's), exit 2, nothing written; a failure on one rank names it."""
    cond = "_os.environ['RANK'] == '1'" if only_rank_1 else "True"
    cfg, out = _write(tmp_path, f"import os as _os\ndef model():\n    if {cond}:\n        raise ValueError('width must be even')\n"
                                "    import torch\n    return torch.nn.Linear(4, 2)\n" + _DATASET)
    res = distkit("train", str(cfg), "--nprocs", "2", "++progress_bar", "False", timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        f"distkit: error: the 'model' factory raised ValueError: width must be even (at {cfg}:5): fix the factory in "
        "the config" + (" (on rank 1)" if only_rank_1 else "")], res.stderr
    assert _written(out) == []


TINY_DATA = '''
import argparse, torch, distkit
p = argparse.ArgumentParser(); distkit.add_arguments(p)
dk = distkit.init(p.parse_args(), progress_bar=False)
model, opt = dk.setup(torch.nn.Linear(2, 2), lambda ps: torch.optim.SGD(ps, lr=0.1))
loader = dk.dataloader(torch.utils.data.TensorDataset(torch.zeros(10, 2)), batch_size=8)  # 10 < 8 x 2 ranks
'''


@pytest.mark.parametrize("engine", ["ddp", "mpi"])
def test_an_error_every_rank_finds_alike_is_one_line_for_the_job(tmp_path: Path, engine: str) -> None:
    """A dataset smaller than the global batch on 2 ranks: every rank found it (the step count is agreed by an
    all-reduce), and it printed one block per rank. Now rank 0 prints the one line; exit 2."""
    script = tmp_path / "tiny.py"
    script.write_text(TINY_DATA)
    res = run([sys.executable, str(script), "--nprocs", "2", "++distributed", f"{{'backend': '{engine}'}}"], timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [ln.lstrip("\x00") for ln in (res.stdout + res.stderr).splitlines() if "make no full global batch" in ln]
    assert lines == ["distkit: error: dk.dataloader: 10 samples make no full global batch of 8 x 2 ranks: use a "
                     "smaller batch_size"], res.stderr[-3000:]
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("engine", ["deepspeed", "ddp", "mpi"])
def test_param_sync_group_size_not_dividing_nprocs_is_refused_before_start(tmp_path: Path, engine: str) -> None:
    res = run([sys.executable, "-m", "distkit", "train", "configs/returnn_ddp.py", "--nprocs", "2", "++output_dir",
               str(tmp_path / "out"), "++distributed", f"{{'backend': '{engine}', 'reduce_type': 'param', "
               "'param_sync_group_size': 3}"], timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines() == ["distkit: error: param_sync_group_size 3 does not divide the world size "
                                               "2 (nprocs): use a divisor of the number of ranks"], res.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_param_sync_group_size_in_grad_mode_is_refused_before_start(tmp_path: Path) -> None:
    # (it once did nothing outside DeepSpeed: a silent grad-mode run)
    res = run([sys.executable, "-m", "distkit", "train", "configs/returnn_ddp.py", "--nprocs", "2", "++output_dir",
               str(tmp_path / "out"), "++distributed", "{'param_sync_group_size': 2}"], timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines() == ["distkit: error: 'distributed.param_sync_group_size' only applies to "
                                               "reduce_type 'param': remove it"], res.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def _special(tmp_path: Path, kind: str) -> str:
    """A path that is no regular file: what it is says the one line."""
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "loop":
        (tmp_path / "loop-b").symlink_to(path)
        path.symlink_to(tmp_path / "loop-b")
    elif kind == "dangling":
        path.symlink_to(tmp_path / "nothing")
    else:
        return "/dev/null"
    return str(path)


SPECIAL = {"fifo": "is a FIFO (named pipe), not a file", "device": "is a character device, not a file",
           "loop": "is a symlink loop", "directory": "is a directory, not a file", "dangling": "is a symlink to nothing"}


@pytest.mark.parametrize("kind", list(SPECIAL))
def test_a_config_path_that_is_no_file_says_what_it_is(tmp_path: Path, kind: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A FIFO, /dev/null, a symlink loop, a directory were all reported as "does not exist" (and a FIFO is never
    opened: reading it would block)."""
    path = _special(tmp_path, kind)
    assert main(["train", path]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"distkit: error: config file '{path}' {SPECIAL[kind]}: check the path"]
    cfg, out = _write(tmp_path, "")
    assert main(["train", str(cfg), "--deepspeed_config", path]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"distkit: error: DeepSpeed config file '{path}' {SPECIAL[kind]}: check the --deepspeed_config path"]
    assert not out.exists()


@pytest.mark.parametrize("kind", ["loop", "loop-parent", "dangling", "long-name"])
def test_an_output_dir_that_cannot_be_created_is_one_line(tmp_path: Path, kind: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A symlink loop or a dangling link on the way, a name over the filesystem's 255 bytes: tracebacks from
    os.makedirs before (FileExistsError, ENAMETOOLONG); now one line, exit 2, nothing written."""
    if kind == "long-name":
        out, words = str(tmp_path / ("x" * 300)), "has a name of 300 bytes, longer than this filesystem allows (255)"
    else:
        link = _special(tmp_path, kind.split("-")[0])
        out = link + "/sub" if kind == "loop-parent" else link
        words = f"'{link}' is {'a symlink loop' if kind.startswith('loop') else 'a symlink to nothing'}"
    cfg, _ = _write(tmp_path, "")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["train", str(cfg), "++output_dir", out]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distkit: error: output_dir ") and words in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == before


BOOM = '''
import torch
task = "digits"
max_steps = 3
progress_bar = False


class _Boom(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x):
        raise MemoryError()


model = _Boom
'''


def test_an_error_without_a_message_still_says_what_failed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``MemoryError()`` (what an allocation that fails raises) gave "rank 0 failed: MemoryError: " with nothing
    after it."""
    cfg, _ = _write(tmp_path, BOOM)
    assert main(["train", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "distkit: rank 0 failed: MemoryError: out of memory (the allocation failed; reduce batch_size" in err, err


# -- issue 62 item 6 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["", "# to do\n\n"], ids=["zero_bytes", "only_a_comment"])
def test_an_empty_python_config(text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A 0-byte .py config trained every default into runs/default; now one line naming the file, as for YAML."""
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.py"
    cfg.write_text(text)
    assert main(["train", str(cfg)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"distkit: error: config file '{cfg}' is empty (no keys): write the keys in it (`distkit keys` lists them), "
        "or task = 'digits' for the defaults"]
    assert list(tmp_path.iterdir()) == [cfg]


STALE = "RANK=0 WORLD_SIZE=2 in the environment, but no launcher set them (no MASTER_ADDR/MASTER_PORT, no torchrun, "


def test_a_leftover_rank_and_world_size_are_one_line_at_once(tmp_path: Path) -> None:
    """``RANK=0 WORLD_SIZE=2`` left in the shell, no launcher: one line naming the variables to unset, before any
    wait (was: a wait for rank 1, or after start-up "rank 0 failed: ConfigError" about MASTER_ADDR)."""
    cfg, out = _write(tmp_path, "task = 'digits'\n")
    res = distkit("train", str(cfg), timeout=60, RANK="0", WORLD_SIZE="2")
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.splitlines() == [
        f"distkit: error: {STALE}mpirun or srun variables), so no other rank will come: unset RANK WORLD_SIZE to run "
        "here (--nprocs N starts N ranks), or start the ranks with torchrun/mpirun/srun (or export MASTER_ADDR and "
        "MASTER_PORT when starting them by hand)"], res.stderr
    assert not out.exists()


def test_a_leftover_rank_in_the_own_loop_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for ``distkit.init`` (a ConfigError, before any engine starts), naming LOCAL_RANK too when set."""
    import distkit as dk_api
    from distkit.errors import ConfigError

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # (init installs its own: restored after the test)
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "DISTKIT_SPAWN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match="unset RANK WORLD_SIZE LOCAL_RANK to run here"):
        dk_api.init({"output_dir": str(tmp_path / "out")})
    assert not (tmp_path / "out").exists()


def test_a_busy_output_dir_is_in_use_not_an_earlier_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank under a launcher (which does not take the lock itself before the checkpoints are read) on an
    output_dir whose lock a live run holds: "in use by another distkit run (pid ...)", not "holds checkpoints of an
    earlier run"; once the lock is free, the earlier run's checkpoints are what the line names."""
    import fcntl

    cfg, out = _write(tmp_path, "task = 'digits'\n")
    (out / "checkpoints" / "step-0000005").mkdir(parents=True)
    holder = "pid 4242 on host node7, started 2024-01-01 00:00:00 UTC"
    fd = os.open(out / ".distkit.lock", os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, holder.encode() + b"\n")
    fcntl.flock(fd, fcntl.LOCK_EX)  # (another open file description: conflicts with one of this process too)
    for name, value in {"TORCHELASTIC_RUN_ID": "t1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                        "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    try:
        assert main(["train", str(cfg)]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"distkit: error: output_dir '{out}' is in use by another distkit run ({holder}): wait for it to end, "
            "stop it, or choose another output_dir"]
    finally:
        os.close(fd)
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "holds checkpoints of an earlier run (newest: step-0000005)" in err and "\n" not in err.strip(), err
    assert sorted(p.name for p in out.rglob("*")) == [".distkit.lock", "checkpoints", "step-0000005"]


def test_fsdp_units_naming_no_module_on_two_ranks_is_one_line(tmp_path: Path) -> None:
    """Every rank finds the same in the same model: one line from rank 0 (was one per rank and the spawner's)."""
    cfg, out = _write(tmp_path, "task = 'digits'\nprogress_bar = False\n")
    res = distkit("train", str(cfg), "--nprocs", "2", "++distributed",
                  "{'backend': 'fsdp', 'fsdp': {'units': ['NoSuchBlock']}}", timeout=120)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.splitlines() == [
        "distkit: error: 'distributed.fsdp.units' ['NoSuchBlock'] names no module of the model: its classes are Linear, "
        "ReLU, Sequential: name some of them, or leave units unset"], res.stderr
    assert _written(out) == []


def test_an_unreachable_mlflow_server_is_one_line_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``loggers = ['mlflow']`` with an http MLFLOW_TRACKING_URI nobody serves: one line at once, nothing written (was:
    MLflow's client retried for minutes, then one line after config.resolved.json and metrics.jsonl were written)."""
    from distkit.launch.spawner import free_port

    uri = f"http://127.0.0.1:{free_port()}"  # (a port just free: nobody listens there)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg, out = _write(tmp_path, "task = 'digits'\nloggers = ['mlflow']\n")
    assert main(["train", str(cfg)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"distkit: error: MLFLOW_TRACKING_URI='{uri}' (loggers 'mlflow') is unreachable (Connection refused, within 5 s): "
        "start the tracking server, fix MLFLOW_TRACKING_URI, or remove 'mlflow' from loggers"]
    assert not out.exists()
