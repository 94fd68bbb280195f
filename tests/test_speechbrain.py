"""distkit.speechbrain (issue 58): two of SpeechBrain's own minimal examples (tests/sb_recipes: ASR_CTC and
speaker_id, vendored from speechbrain/speechbrain) with one changed line, ``import distkit.speechbrain as sb``, on
every engine through SpeechBrain's own command lines, against the same recipe under SpeechBrain's own DDP.

The reference is SpeechBrain's DDP (torchrun, gloo) without its SyncBatchNorm conversion, which torch allows on CUDA
only (tests/sb_recipes/run.py --no-syncbn): BatchNorm statistics as plain DDP keeps them, the same as distkit's.
Compared: the end-of-training checkpoint the recipe's Checkpointer writes (every tensor file: the modules, the
InputNormalization statistics), the train log SpeechBrain writes (train and valid loss, PER), every rank's final
model (tests/sb_recipes/run.py: after ``evaluate`` loaded the best checkpoint) and distkit's ``ranks_in_sync``.
"""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import BIN, ROOT, ok, run

RECIPES = ROOT / "tests" / "sb_recipes"
RUN = str(RECIPES / "run.py")
TORCHRUN = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", "0", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "localhost:0"]
MPIRUN = [str(BIN / "mpirun"), "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable]
ZERO2 = ["++distributed.backend", "deepspeed", "++distributed.deepspeed_config",
         '{"zero_optimization": {"stage": 2}}']


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SpeechBrain's tests/samples layout, generated (tests/sb_recipes/make_data.py)."""
    where = tmp_path_factory.mktemp("sb_data")
    ok(run([sys.executable, str(RECIPES / "make_data.py"), str(where)]))
    return where


def converted(recipe: str, where: Path) -> Path:
    """The recipe with its one changed line (``import speechbrain as sb`` -> ``import distkit.speechbrain as sb``)."""
    text = (RECIPES / recipe / "train.py").read_text()
    new = text.replace("\nimport speechbrain as sb\n", "\nimport distkit.speechbrain as sb\n")
    changed = [(a, b) for a, b in zip(text.splitlines(), new.splitlines()) if a != b]
    assert changed == [("import speechbrain as sb", "import distkit.speechbrain as sb")], changed
    path = where / f"{recipe}_distkit.py"
    path.write_text(new)
    return path


def recipe_args(recipe: str, data: Path, out: Path, *extra: str) -> list[str]:
    return [str(RECIPES / recipe / "hparams.yaml"), "--data_folder", str(data), "--output_folder", str(out),
            "--noprogressbar", *extra]


def last_checkpoint(out: Path) -> dict[str, Any]:
    """Every file of the end-of-training checkpoint (the one whose epoch counter is the last): tensors loaded."""
    found = {}
    for ckpt in (out / "save").glob("CKPT+*"):
        found[int((ckpt / "counter.ckpt").read_text())] = ckpt
    ckpt = found[max(found)]
    return {f.name: torch.load(f, weights_only=True) for f in sorted(ckpt.glob("*.ckpt"))
            if f.is_file() and f.name not in ("brain.ckpt", "dataloader-TRAIN.ckpt", "counter.ckpt")}


def tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in tensors(val, f"{prefix}.{key}").items()}
    return {prefix: torch.tensor(float(obj))} if isinstance(obj, (int, float)) else {}


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    ta, tb = tensors(a), tensors(b)
    assert set(ta) == set(tb), sorted(set(ta) ^ set(tb))
    return max((ta[k].double() - tb[k].double()).abs().max().item() for k in ta)


def final(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"final-{rank}.pt", weights_only=True)


def in_sync(out: Path) -> list[bool]:
    return [json.loads((out / f"summary-{r}.json").read_text())["ranks_in_sync"] for r in (0, 1)]


def reference(data: Path, out: Path, *extra: str) -> Path:
    """ASR_CTC under SpeechBrain's own DDP: torchrun, --distributed_backend gloo, SyncBatchNorm conversion off."""
    ok(run([*TORCHRUN, RUN, "--no-syncbn", str(RECIPES / "asr_ctc" / "train.py"),
            *recipe_args("asr_ctc", data, out, "--distributed_backend", "gloo", *extra)], timeout=240))
    return out


#: SpeechBrain's gradient accumulation: 2 micro-batches per step (no_sync on the first)
ACCUM = ("--grad_accumulation_factor", "2")


@pytest.fixture(scope="module")
def asr_reference(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return reference(data, tmp_path_factory.mktemp("sb_ref") / "out", *ACCUM)


#: SpeechBrain's clipping off (a norm no gradient reaches): DeepSpeed clips inside its step with a norm summed over its
#: partitions, which rounds differently from torch's ``clip_grad_norm_``, and Adam carries a last-bit difference in a
#: near-zero gradient on to a step of ``lr`` (docs/integrations.md: 1.6e-2 on this recipe with clipping, 0 without);
#: likewise its accumulation, which sums the micro-steps' reduced gradients in its partitions (9.2e-3 with ACCUM)
NO_CLIP = ("--max_grad_norm", "1e9")


@pytest.fixture(scope="module")
def asr_reference_unclipped(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return reference(data, tmp_path_factory.mktemp("sb_ref_unclipped") / "out", *NO_CLIP)


#: engine -> the command line a SpeechBrain user runs (SpeechBrain's own: torchrun, mpirun, plain python)
ENGINES = {
    "ddp": (TORCHRUN, ACCUM),
    "mpi": (MPIRUN, ("++distributed.backend", "mpi", *ACCUM)),
    "horovod": (MPIRUN, ("++use_horovod", "True", *ACCUM)),
    "deepspeed": ([sys.executable], ("--nprocs", "2", *ZERO2, *NO_CLIP)),
    "fsdp": ([sys.executable], ("--nprocs", "2", "++distributed.backend", "fsdp", *ACCUM)),
}


@pytest.mark.parametrize("engine", ["ddp", "mpi", "horovod", "deepspeed", "fsdp"])
def test_asr_ctc_with_one_changed_line_ends_where_speechbrains_ddp_ends(engine: str, data: Path, tmp_path: Path,
                                                                     request: pytest.FixtureRequest) -> None:
    """Grad mode on every engine: the checkpoint SpeechBrain's Checkpointer writes at the end (CRDNN with BatchNorm,
    LiGRU, dropout; InputNormalization's statistics, all-reduced by SpeechBrain through the engine), the train log
    (train and valid loss, PER: the validation SpeechBrain runs on every rank), every rank's final model after
    ``evaluate`` recovered the best checkpoint, clipping (SpeechBrain's max_grad_norm 5, on the first param group),
    gradient accumulation (2): bit for bit on ddp, mpi, horovod and fsdp; on ZeRO-2 bit for bit without clipping
    and accumulation (see NO_CLIP)."""
    launcher, extra = ENGINES[engine]
    asr_reference = request.getfixturevalue("asr_reference_unclipped" if engine == "deepspeed" else "asr_reference")
    out = tmp_path / "out"
    ok(run([*launcher, RUN, str(converted("asr_ctc", tmp_path)), *recipe_args("asr_ctc", data, out, *extra)],
           timeout=240))
    assert json.loads((out / "summary-0.json").read_text())["backend"] == engine
    ours, theirs = last_checkpoint(out), last_checkpoint(asr_reference)
    if engine in ("deepspeed", "fsdp"):  # their optimizer state is partitioned: in distkit.ckpt, per rank
        assert "optimizer.ckpt" not in ours and (out / "save").glob("CKPT+*/distkit.ckpt")
        theirs.pop("optimizer.ckpt")
    assert max_diff(ours, theirs) == 0.0
    assert in_sync(out) == [True, True]
    if engine != "deepspeed":  # (ZeRO keeps fp32 partitions of its own, which evaluate's recovery does not load)
        for rank in (0, 1):
            assert max_diff(final(out, rank), final(asr_reference, rank)) == 0.0, rank
    assert (out / "train_log.txt").read_text() == (asr_reference / "train_log.txt").read_text()
    # exactly one rank wrote: one experiment directory's files, one log line per epoch
    assert len((out / "train_log.txt").read_text().splitlines()) == 3


#: param mode, every 4th step averaged; dropout off: SpeechBrain's LiGRU draws its recurrent dropout masks from a pool
#: whose position (``drop_mask_cnt``, speechbrain/nnet/RNN.py) is no buffer, so no checkpoint holds it (SpeechBrain's
#: own neither) and a resumed run draws other masks; SpeechBrain's clipping off (NO_CLIP), so that ZeRO-2 ends bit
#: for bit as the other engines (with it: 9.2e-3, DeepSpeed's norm as in grad mode)
PARAM = ("++distributed.reduce_type", "param", "++distributed.param_sync_step", "4", "--dropout", "0.0", *NO_CLIP)


def param_args(data: Path, out: Path, *extra: str) -> list[str]:
    return recipe_args("asr_ctc", data, out, *extra, *PARAM, "--ckpt_interval_steps", "2")


@pytest.fixture(scope="module")
def param_ddp(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ASR_CTC in param mode on the ddp engine (``--nprocs 2``), with SpeechBrain's intra-epoch checkpoints."""
    where = tmp_path_factory.mktemp("sb_param")
    out = where / "ddp"
    ok(run([sys.executable, RUN, str(converted("asr_ctc", where)), *param_args(data, out, "--nprocs", "2")],
           timeout=240))
    assert in_sync(out) == [True, True]
    return out


def test_param_mode_inside_a_brain_is_the_same_on_ddp_and_mpi(data: Path, param_ddp: Path, tmp_path: Path) -> None:
    """Param mode (local steps, every 4th averaged) in ASR_CTC: the ranks hold one model at the end (the final
    sync), and ddp (``--nprocs 2``) and mpi (under mpirun) end bit for bit alike: every rank's final model, the
    checkpoint SpeechBrain's Checkpointer wrote (its module files: the mean of the replicas) and the train log
    (:func:`assert_ends_as_param_ddp`)."""
    out = tmp_path / "mpi"
    ok(run(param_command("mpi", converted("asr_ctc", tmp_path), data, out), timeout=240))
    assert max_diff(final(param_ddp, 0), final(param_ddp, 1)) == 0.0
    assert_ends_as_param_ddp(out, param_ddp, "mpi")


#: engine -> the command line of a param-mode run on it (SpeechBrain's launchers: mpirun for Horovod; FSDP's
#: ``--nprocs 2``, as the ddp reference's)
PARAM_ENGINES = {
    "ddp": ([sys.executable], ("--nprocs", "2")),
    "mpi": (MPIRUN, ("++distributed.backend", "mpi")),
    "horovod": (MPIRUN, ("++use_horovod", "True")),
    "deepspeed": ([sys.executable], ("--nprocs", "2", *ZERO2)),
    "fsdp": ([sys.executable], ("--nprocs", "2", "++distributed.backend", "fsdp")),
}


def param_command(engine: str, script: Path, data: Path, out: Path) -> list[str]:
    """The param-mode ASR_CTC command line on ``engine``, writing to ``out``."""
    launcher, extra = PARAM_ENGINES[engine]
    return [*launcher, RUN, str(script), *param_args(data, out, *extra)]


def assert_ends_as_param_ddp(out: Path, param_ddp: Path, engine: str) -> None:
    """The run in ``out`` ran on ``engine`` and ends bit for bit as the param-mode run on the ddp engine: the ranks
    in sync, every rank's final model, every file of the checkpoint SpeechBrain's Checkpointer wrote last (its
    module files: the mean of the replicas, epoch 3 ending 2 steps after a sync; the optimizer's where the engine
    keeps it whole, ZeRO and FSDP keeping their partitions in the ``distkit`` recoverable only) and the train log
    (every epoch's validation, run on the mean of the replicas where they differ: after epochs 1 and 3)."""
    assert json.loads((out / "summary-0.json").read_text())["backend"] == engine
    assert in_sync(out) == [True, True]
    for rank in (0, 1):
        assert max_diff(final(out, rank), final(param_ddp, 0)) == 0.0, rank
    ours, theirs = last_checkpoint(out), last_checkpoint(param_ddp)
    if engine in ("deepspeed", "fsdp"):
        assert "optimizer.ckpt" not in ours
        theirs.pop("optimizer.ckpt")
    assert max_diff(ours, theirs) == 0.0
    assert (out / "train_log.txt").read_text() == (param_ddp / "train_log.txt").read_text()


def test_param_mode_inside_a_brain_on_horovod_zero2_and_fsdp_is_ddps(data: Path, param_ddp: Path,
                                                                      tmp_path: Path) -> None:
    """Param mode in ASR_CTC (as the test above) under mpirun on Horovod, and under ``--nprocs 2`` on ZeRO-2 (whose
    averaged tensors are DeepSpeed's fp32 masters: the replicas' mean reaches the weights validation runs on) and
    FSDP (whose Checkpointer module files are gathered whole, from the mean of the replicas while they differ), the
    three runs side by side: each ends bit for bit as the ddp engine's run (:func:`assert_ends_as_param_ddp`)."""
    script = converted("asr_ctc", tmp_path)
    engines = ("horovod", "deepspeed", "fsdp")
    with ThreadPoolExecutor(len(engines)) as pool:
        runs = {e: pool.submit(run, param_command(e, script, data, tmp_path / e), timeout=240) for e in engines}
        for engine, future in runs.items():
            ok(future.result())
    for engine in engines:
        assert_ends_as_param_ddp(tmp_path / engine, param_ddp, engine)


#: two launches, plus the param_ddp fixture's 50-94 s when this test is the first to use it (a -k selection): past
#: setup.cfg's 180 s (which counts setup) at load 20
@pytest.mark.timeout(400)
def test_a_brain_killed_mid_epoch_in_param_mode_resumes_the_same_run(data: Path, param_ddp: Path,
                                                                     tmp_path: Path) -> None:
    """A rank killed with SIGKILL at step 9 (mid-epoch 2), after SpeechBrain's intra-epoch checkpoint at step 8
    (``--ckpt_interval_steps 2``), and the same command again (SpeechBrain's ``recover_if_possible``: each rank's
    replica, optimizer moments, averager and random streams from the ``distkit`` recoverable) ends bit for bit where
    the run that was not stopped ends (:func:`assert_ends_as_param_ddp`)."""
    out = tmp_path / "killed"
    args = param_command("ddp", converted("asr_ctc", tmp_path), data, out)
    killed = run(args, timeout=240, DISTKIT_FAULT="1:9:kill")
    assert killed.returncode != 0 and not (out / "final-0.pt").exists(), killed.stderr[-2000:]
    assert any((out / "save").glob("CKPT+*/distkit.ckpt")), "no checkpoint before the kill"
    ok(run(args, timeout=240))
    assert_ends_as_param_ddp(out, param_ddp, "ddp")


def killed_then_resumed(engine: str, script: Path, data: Path, out: Path) -> None:
    """S10's kill and resume on ``engine``'s own command line (:data:`PARAM_ENGINES`): rank 1 SIGKILLed at step 9
    (``DISTKIT_FAULT``), which must end the job in epoch 2 (one train-log line) with no final model but leave the
    step-8 intra-epoch checkpoint's ``distkit`` recoverable; then the same command again, which must exit 0. What
    it ends with is compared by the caller."""
    args = param_command(engine, script, data, out)
    killed = run(args, timeout=240, DISTKIT_FAULT="1:9:kill")
    assert killed.returncode != 0 and not (out / "final-0.pt").exists(), (engine, killed.stderr[-2000:])
    assert any((out / "save").glob("CKPT+*/distkit.ckpt")), (engine, "no checkpoint before the kill")
    # killed in epoch 2: epoch 1's line only (the resumed run adds epochs 2 and 3; a run that started over instead of
    # recovering would write epoch 1's again, and its log would not be the reference's)
    assert len((out / "train_log.txt").read_text().splitlines()) == 1, engine
    ok(run(args, timeout=240))


#: two launches per engine, four engines side by side: 83 s on a quieter machine, 152-172 s at load 20, plus the
#: param_ddp fixture's 50-94 s when this test is the first to use it: past setup.cfg's 180 s (which counts setup)
@pytest.mark.timeout(400)
def test_a_brain_killed_mid_epoch_in_param_mode_on_mpi_horovod_zero2_and_fsdp_resumes_the_same_run(
        data: Path, param_ddp: Path, tmp_path: Path) -> None:
    """S10 (a rank SIGKILLed at step 9, mid-epoch 2, after the intra-epoch checkpoint at step 8; then the same
    command) on mpi and Horovod under mpirun (where the killed rank makes mpirun end the job) and on ZeRO-2 and FSDP
    under ``--nprocs 2`` (whose replicas and optimizer partitions come back from each rank's ``distkit`` recoverable),
    the four side by side (:func:`killed_then_resumed`): each resumed run ends bit for bit where the uninterrupted
    param-mode run on the ddp engine ends (:func:`assert_ends_as_param_ddp`: final models, the last checkpoint's
    files, the train log) -- which S6 and S15 check each engine's uninterrupted run equals, so the kill changed
    nothing."""
    script = converted("asr_ctc", tmp_path)
    engines = ("mpi", "horovod", "deepspeed", "fsdp")
    with ThreadPoolExecutor(len(engines)) as pool:
        runs = {e: pool.submit(killed_then_resumed, e, script, data, tmp_path / e) for e in engines}
        for future in runs.values():
            future.result()
    for engine in engines:
        assert_ends_as_param_ddp(tmp_path / engine, param_ddp, engine)


def test_speaker_id_on_horovod_in_param_mode_with_diloco_keeps_speechbrains_helpers_on_one_rank(
        data: Path, tmp_path: Path) -> None:
    """speaker_id (x-vector TDNN with BatchNorm, Fbank, InputNormalization) in DiLoCo (an outer Nesterov step at
    every sync) under mpirun on Horovod, the mode from a ``distributed:`` block in the recipe's hparams YAML (plain
    values beside HyperPyYAML's tags), the engine from the command line (``++use_horovod True``): as
    :func:`assert_speaker_id_in_diloco` says."""
    script, hparams = speaker_id_in_diloco(tmp_path)
    out = tmp_path / "out"
    args = recipe_args("speaker_id", data, out, "++use_horovod", "True")
    ok(run([*MPIRUN, RUN, str(script), str(hparams), *args[1:]], timeout=240))
    assert_speaker_id_in_diloco(out, "horovod")


def speaker_id_in_diloco(where: Path) -> tuple[Path, Path]:
    """The converted speaker_id recipe and its hparams file with a ``distributed:`` block: DiLoCo, every step a
    sync with an outer Nesterov step (lr 0.7, momentum 0.9)."""
    hparams = where / "hparams.yaml"
    hparams.write_text((RECIPES / "speaker_id" / "hparams.yaml").read_text() + "\ndistributed:\n  reduce_type: param\n"
                       "  param_sync_step: 1\n  outer_optimizer: {class: nesterov, lr: 0.7, momentum: 0.9}\n")
    return converted("speaker_id", where), hparams


def assert_speaker_id_in_diloco(out: Path, engine: str) -> None:
    """The run in ``out`` took the engine from the command line and the mode from the hparams block; the ranks are
    in sync at the end (every rank's final model the same); SpeechBrain's main-process helpers (the experiment
    directory, the train logger, the checkpointer) wrote once: one log line per epoch."""
    summary = json.loads((out / "summary-0.json").read_text())
    assert (summary["backend"], summary["reduce_type"], summary["param_sync_step"]) == (engine, "param", 1)
    assert summary["outer_optimizer"] == {"class": "nesterov", "lr": 0.7, "momentum": 0.9}, summary
    assert in_sync(out) == [True, True]
    assert max_diff(final(out, 0), final(out, 1)) == 0.0
    assert len((out / "train_log.txt").read_text().splitlines()) == 3


def test_speaker_id_in_diloco_from_the_hparams_block_on_ddp_mpi_zero2_and_fsdp(data: Path, tmp_path: Path) -> None:
    """The test above on the other engines, each on its own command line (torchrun for ddp, mpirun for mpi,
    ``--nprocs 2`` for ZeRO-2 and FSDP), the four runs side by side: each as :func:`assert_speaker_id_in_diloco`
    says."""
    script, hparams = speaker_id_in_diloco(tmp_path)
    engines = {"ddp": (TORCHRUN, ()), "mpi": (MPIRUN, ("++distributed.backend", "mpi")),
               "deepspeed": ([sys.executable], ("--nprocs", "2", *ZERO2)),
               "fsdp": ([sys.executable], ("--nprocs", "2", "++distributed.backend", "fsdp"))}

    def diloco(launcher: list[str], extra: tuple[str, ...], out: Path) -> subprocess.CompletedProcess[str]:
        args = recipe_args("speaker_id", data, out, *extra)
        return run([*launcher, RUN, str(script), str(hparams), *args[1:]], timeout=240)

    with ThreadPoolExecutor(len(engines)) as pool:
        runs = {e: pool.submit(diloco, launcher, extra, tmp_path / e) for e, (launcher, extra) in engines.items()}
        for engine, future in runs.items():
            ok(future.result())
    for engine in engines:
        assert_speaker_id_in_diloco(tmp_path / engine, engine)


@pytest.mark.parametrize("flag, expected", [
    (("--data_parallel_backend",), "--data_parallel_backend"),
    (("--grad_accumulation_factor", "4"), "grad_accumulation_factor 4 with 6 training batches"),
])
def test_what_a_brain_cannot_do_stops_before_training_in_one_line(flag: tuple[str, ...], expected: str, data: Path,
                                                                  tmp_path: Path) -> None:
    """Refusals, exit 2, one line naming the fix, before the first step (see :func:`assert_refused`)."""
    out = tmp_path / "out"
    res = run([sys.executable, str(converted("asr_ctc", tmp_path)),
               *recipe_args("asr_ctc", data, out, "--nprocs", "2", *flag)], timeout=240)
    assert_refused(res, expected, out)


def assert_refused(res: subprocess.CompletedProcess[str], expected: str, out: Path) -> None:
    """A refusal as documented: exit 2, one ``distkit: error`` line holding ``expected`` (under mpirun a refusal
    before the job exists, when the recipe joins, is each rank's: the same line, once per rank that printed it
    before mpirun ended the job; after, every rank agrees and rank 0 prints it once); no traceback (SpeechBrain's
    excepthook on the main process logs one to stdout: distkit's hook must come first) and no MPI abort (Open MPI's
    banner, where a rank aborts the others); no checkpoint written."""
    assert res.returncode == 2, (expected, res.returncode, res.stderr[-3000:])
    errors = {line for line in res.stderr.splitlines() if line.startswith("distkit: error")}
    assert len(errors) == 1 and expected in next(iter(errors)), (expected, res.stderr[-3000:])
    assert "Traceback" not in res.stdout + res.stderr and "MPI_ABORT" not in res.stderr, \
        (expected, res.stdout[-3000:], res.stderr[-3000:])
    assert not list(out.glob("save/CKPT+*")), expected


#: engine -> the command line a SpeechBrain user runs for it: ENGINES's, without the accumulation (the refusals'
#: own flags set it)
REFUSING = {engine: (launcher, extra[:-len(ACCUM)] if extra[-len(ACCUM):] == ACCUM else extra)
            for engine, (launcher, extra) in ENGINES.items()}


@pytest.mark.parametrize("engine", ["mpi", "horovod", "deepspeed", "fsdp"])
def test_what_a_brain_cannot_do_stops_before_training_in_one_line_on_every_engine(engine: str, data: Path,
                                                                                  tmp_path: Path) -> None:
    """The two refusals of the test above, and fp16's, on the other engines' own command lines (mpirun for mpi and
    Horovod, ``--nprocs 2`` for ZeRO-2 and FSDP): ``--data_parallel_backend`` (refused when the recipe joins,
    before any rank starts), an epoch of 6 batches per rank with ``--grad_accumulation_factor 4`` (refused by every rank
    together when ``fit`` makes the training loader, after the engine started, before the first step) and
    ``--precision fp16`` (refused by every rank when the Brain is made), each as :func:`assert_refused` says. The
    runs go side by side (each is mostly imports and start-up)."""
    launcher, extra = REFUSING[engine]
    cases = {"--data_parallel_backend": ("--data_parallel_backend",),
             "grad_accumulation_factor 4 with 6 training batches": ("--grad_accumulation_factor", "4"),
             "--precision fp16 (a GradScaler steps the optimizer itself)": ("--precision", "fp16")}
    script = str(converted("asr_ctc", tmp_path))

    def refused(flag: tuple[str, ...], out: Path) -> subprocess.CompletedProcess[str]:
        return run([*launcher, script, *recipe_args("asr_ctc", data, out, *extra, *flag)], timeout=240)

    with ThreadPoolExecutor(len(cases)) as pool:
        results = {expected: (pool.submit(refused, flag, tmp_path / f"out{i}"), tmp_path / f"out{i}")
                   for i, (expected, flag) in enumerate(cases.items())}
        for expected, (future, out) in results.items():
            assert_refused(future.result(), expected, out)
