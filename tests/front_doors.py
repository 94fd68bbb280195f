"""The conformance suite's front-door axis (issue 57), as data: what each bridge gives for each idiom it can express.

The own-loop suite (``tests/test_conformance.py``) runs one idioms script on every engine and mode. The front doors
are the frameworks' own loops with distkit plugged in: Lightning's ``Trainer`` (``distkit.lightning.DistkitStrategy``),
Lightning's ``Fabric`` (the same strategy), ``transformers.Trainer`` (``distkit.hf.DistkitTrainer``), Accelerate
loops (``distkit.hf.ParamSync``) and SpeechBrain recipes (``distkit.speechbrain.Brain``, ``tests/test_speechbrain.py``). Their comparisons already run in real processes in ``tests/test_lightning.py``,
``tests/test_hf.py`` and ``tests/test_bridge_kill.py`` (a few jobs, each measuring many things in one start: the
suite's time is spent); this module adds no process. It states, per front door, idiom, mode and engine, what those
tests assert and which test asserts it:

- :data:`IDENTICAL`: asserted bit for bit (``torch.equal``, a difference ``== 0.0``, or ``==``) against the row's
  reference;
- :data:`CLOSE`: asserted within 1e-6 of the row's reference (the largest difference of any tensor or value);
- :data:`RUNS`: the engine is taken (the row "engine choice"), with the test of a run on it;
- :data:`REFERENCE`: the row's reference itself (a row comparing the other engines with this one's run), with the
  test that runs it;
- a refusal: the documented one-line error, shown by phrases of it that the test asserts;
- :data:`NOT_OFFERED`: the bridge does not take that engine or mode (:data:`OFFERED`, docs/integrations.md's
  "What each engine does inside each framework"); no result is claimed;
- :data:`UNTESTED`: the bridge takes the engine and mode, but no test asserts the idiom there.

:func:`render_table` is the markdown ``docs/integrations.md`` shows; ``tests/test_front_doors.py`` keeps the two equal,
checks that every test named exists and that no cell claims a result without a test.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

#: the engines (the columns), in docs/integrations.md's order
ENGINES: tuple[str, ...] = ("ddp", "mpi", "horovod", "deepspeed", "fsdp")
MODES: tuple[str, ...] = ("grad", "param")

IDENTICAL = "identical"
CLOSE = "Δ ≤ 1e-6"
RUNS = "runs"
REFERENCE = "the reference"
REFUSED = "refused"
NOT_OFFERED = "not offered"
UNTESTED = "untested"
#: the results that claim something, and so need a test
CLAIMS: frozenset[str] = frozenset({IDENTICAL, CLOSE, RUNS, REFERENCE, REFUSED})

LIGHTNING = "Lightning `Trainer` (`DistkitStrategy`)"
FABRIC = "Lightning `Fabric` (`DistkitStrategy`)"
TRAINER = "`transformers.Trainer` (`DistkitTrainer`)"
PARAMSYNC = "Accelerate loop (`ParamSync`)"
SPEECHBRAIN = "SpeechBrain `Brain` (`import distkit.speechbrain as sb`)"
DOORS: tuple[str, ...] = (LIGHTNING, FABRIC, TRAINER, PARAMSYNC, SPEECHBRAIN)


def _pairs(engines: tuple[str, ...], modes: tuple[str, ...]) -> frozenset[tuple[str, str]]:
    """Every (engine, mode) of ``engines`` x ``modes``."""
    return frozenset((e, m) for e in engines for m in modes)


#: front door -> the (engine, mode) pairs it takes (docs/integrations.md): Lightning's strategy leaves DeepSpeed and
#: FSDP to Lightning's own strategies; both Hugging Face bridges run on Accelerate's torch.distributed group (the ddp
#: engine), ParamSync in param mode only (an Accelerate loop's grad mode is Accelerate's own DDP)
OFFERED: dict[str, frozenset[tuple[str, str]]] = {
    LIGHTNING: _pairs(("ddp", "mpi", "horovod"), MODES),
    FABRIC: _pairs(("ddp", "mpi", "horovod"), MODES),
    TRAINER: _pairs(("ddp",), MODES),
    PARAMSYNC: _pairs(("ddp",), ("param",)),
    SPEECHBRAIN: _pairs(ENGINES, MODES),
}

#: label -> pytest node id of a test that asserts the cells citing the label
TESTS: dict[str, str] = {
    "L1": "tests/test_lightning.py::test_grad_mode_ddp_under_lightnings_launcher_equals_ddpstrategy_and_resumes",
    "L2": "tests/test_lightning.py::test_grad_mode_mpi_engines_under_nprocs_equal_ddpstrategy",
    "L3": "tests/test_lightning.py::test_param_mode_equals_own_loop_and_resumes_from_checkpoint",
    "L4": "tests/test_lightning.py::test_a_torchmetrics_metric_logged_on_the_mpi_and_horovod_engines_is_ddps_value",
    "L5": "tests/test_lightning.py::test_fabric_grad_mode_equals_fabric_ddp_and_param_mode_equals_own_loop",
    "L6": "tests/test_lightning.py::test_refusals_are_one_line_and_core_does_not_import_lightning",
    "L7": "tests/test_lightning.py::test_example_bug_report_template_on_the_mpi_engine",
    "H1": "tests/test_hf.py::test_distkit_trainer_grad_mode_equals_the_trainers_ddp",
    "H2": "tests/test_hf.py::test_distkit_trainer_param_mode_equals_own_loop_and_resumes",
    "H3": "tests/test_hf.py::test_load_best_model_at_end_in_param_mode_is_the_evaluated_model[best]",
    "H4": "tests/test_hf.py::test_load_best_model_at_end_in_param_mode_is_the_evaluated_model[best-outer]",
    "H5": "tests/test_hf.py::test_distkit_trainer_refusals_name_the_fix_before_writing_anything",
    "H6": "tests/test_hf.py::test_refusals_are_one_line_exit_2_on_every_rank",
    "H7": "tests/test_hf.py::test_param_sync_is_local_sgd_bit_for_bit",
    "H8": "tests/test_hf.py::test_param_sync_extras_equal_distkits_own_loop",
    "H9": "tests/test_hf.py::test_save_state_mid_period_resumes_bit_for_bit",
    "H10": "tests/test_hf.py::test_distkit_trainer_grad_mode_resumes_where_it_ended_with_dropout",
    "H11": "tests/test_hf.py::test_distkit_trainer_param_mode_accumulation_schedule_log_and_predict_equal_own_loop",
    "K1": "tests/test_bridge_kill.py::"
          "test_lightning_trainer_killed_during_fit_resumes_from_last_as_the_uninterrupted_run[ddp]",
    "K2": "tests/test_bridge_kill.py::"
          "test_lightning_trainer_killed_during_fit_resumes_from_last_as_the_uninterrupted_run[mpi]",
    "K3": "tests/test_bridge_kill.py::"
          "test_lightning_trainer_killed_during_fit_resumes_from_last_as_the_uninterrupted_run[horovod]",
    "K4": "tests/test_bridge_kill.py::test_fabric_killed_resumes_from_its_last_save_as_the_uninterrupted_run[ddp]",
    "K5": "tests/test_bridge_kill.py::test_fabric_killed_resumes_from_its_last_save_as_the_uninterrupted_run[mpi]",
    "K6": "tests/test_bridge_kill.py::test_fabric_killed_resumes_from_its_last_save_as_the_uninterrupted_run[horovod]",
    "K7": "tests/test_bridge_kill.py::test_distkit_trainer_killed_resumes_from_checkpoint_as_the_uninterrupted_run",
    "K8": "tests/test_bridge_kill.py::test_param_sync_killed_resumes_from_load_state_as_the_uninterrupted_run",
    "S1": "tests/test_speechbrain.py::test_asr_ctc_with_one_changed_line_ends_where_speechbrains_ddp_ends[ddp]",
    "S2": "tests/test_speechbrain.py::test_asr_ctc_with_one_changed_line_ends_where_speechbrains_ddp_ends[mpi]",
    "S3": "tests/test_speechbrain.py::test_asr_ctc_with_one_changed_line_ends_where_speechbrains_ddp_ends[horovod]",
    "S4": "tests/test_speechbrain.py::test_asr_ctc_with_one_changed_line_ends_where_speechbrains_ddp_ends[fsdp]",
    "S5": "tests/test_speechbrain.py::test_asr_ctc_with_one_changed_line_ends_where_speechbrains_ddp_ends[deepspeed]",
    "S6": "tests/test_speechbrain.py::test_param_mode_inside_a_brain_is_the_same_on_ddp_and_mpi",
    "S10": "tests/test_speechbrain.py::test_a_brain_killed_mid_epoch_in_param_mode_resumes_the_same_run",
    "S7": "tests/test_speechbrain.py::"
          "test_speaker_id_on_horovod_in_param_mode_with_diloco_keeps_speechbrains_helpers_on_one_rank",
    "S8": "tests/test_speechbrain.py::test_what_a_brain_cannot_do_stops_before_training_in_one_line[flag0---data_parallel_backend]",
    "S9": "tests/test_speechbrain.py::"
          "test_what_a_brain_cannot_do_stops_before_training_in_one_line[flag1-grad_accumulation_factor 4 with 6 training batches]",
    "S11": "tests/test_speechbrain.py::test_what_a_brain_cannot_do_stops_before_training_in_one_line_on_every_engine[mpi]",
    "S12": "tests/test_speechbrain.py::"
           "test_what_a_brain_cannot_do_stops_before_training_in_one_line_on_every_engine[horovod]",
    "S13": "tests/test_speechbrain.py::"
           "test_what_a_brain_cannot_do_stops_before_training_in_one_line_on_every_engine[deepspeed]",
    "S14": "tests/test_speechbrain.py::"
           "test_what_a_brain_cannot_do_stops_before_training_in_one_line_on_every_engine[fsdp]",
    "S15": "tests/test_speechbrain.py::test_param_mode_inside_a_brain_on_horovod_zero2_and_fsdp_is_ddps",
    "S16": "tests/test_speechbrain.py::test_speaker_id_in_diloco_from_the_hparams_block_on_ddp_mpi_zero2_and_fsdp",
    "S17": "tests/test_speechbrain.py::"
           "test_a_brain_killed_mid_epoch_in_param_mode_on_mpi_horovod_zero2_and_fsdp_resumes_the_same_run",
}


@dataclass(frozen=True)
class Cell:
    """One engine's result for one idiom and mode: a result of the vocabulary above, the labels of the tests (of
    :data:`TESTS`) that assert it, and for a refusal the phrases of its one line that those tests assert."""

    result: str
    tests: tuple[str, ...] = ()
    phrases: tuple[str, ...] = ()

    def shown(self) -> str:
        """The cell as the table shows it: ``Δ ≤ 1e-6 (L1)``, ``refused: "...DeepSpeedStrategy..." (L6)``."""
        text = f'{REFUSED}: "...{"...".join(self.phrases)}..."' if self.result == REFUSED else self.result
        return f"{text} ({', '.join(self.tests)})" if self.tests else text


def identical(*tests: str) -> Cell:
    """Asserted bit for bit against the row's reference by ``tests``."""
    return Cell(IDENTICAL, tests)


def close(*tests: str) -> Cell:
    """Asserted within 1e-6 of the row's reference by ``tests``."""
    return Cell(CLOSE, tests)


def runs(*tests: str) -> Cell:
    """The engine is taken: ``tests`` run it."""
    return Cell(RUNS, tests)


def reference(*tests: str) -> Cell:
    """The row's reference: the other engines' cells are compared with this engine's run, which ``tests`` make."""
    return Cell(REFERENCE, tests)


def refused(phrases: tuple[str, ...], *tests: str) -> Cell:
    """The documented one-line refusal, of which ``tests`` assert ``phrases``."""
    return Cell(REFUSED, tests, phrases)


@dataclass(frozen=True)
class Row:
    """One idiom of one front door in one mode: what it is compared with, and each engine's cell."""

    door: str
    idiom: str
    mode: str
    compared_with: str
    cells: Mapping[str, Cell]


def row(door: str, idiom: str, mode: str, compared_with: str, **given: Cell) -> Row:
    """A row with the cells ``given`` by engine; every other engine's cell is :data:`NOT_OFFERED` where the front
    door does not take that engine in ``mode`` (:data:`OFFERED`), else :data:`UNTESTED`."""
    assert set(given) <= set(ENGINES) and door in DOORS and mode in MODES, (door, mode, sorted(given))
    cells = {e: given.get(e) or Cell(NOT_OFFERED if (e, mode) not in OFFERED[door] else UNTESTED) for e in ENGINES}
    return Row(door, idiom, mode, compared_with, cells)


DDPSTRATEGY = "Lightning's `DDPStrategy` (same module, seed, data)"
OWN_LOOP = "distkit's own loop (same model, data order, settings)"
CLOSED_FORM = "the one-process loss of the final weights over the whole set"
UNINTERRUPTED = "the uninterrupted run"
FABRIC_DDP = "Fabric's own `ddp` strategy"
STOCK = "the stock `transformers.Trainer` (its DDP)"
OWN_ON_BATCHES = "distkit's own loop on the batches the Trainer drew"
LOCALSGD = "Accelerate's `LocalSGD`"
REFUSAL = "refused: the asserted text; runs: a test's run on it"
SB_DDP = "SpeechBrain's own DDP (torchrun, gloo; SyncBatchNorm conversion off)"

#: engine -> its refusal by ``DistkitStrategy(...)``: in its constructor, before the Trainer or Fabric it is given to
_LIGHTNING_ENGINES = dict(deepspeed=refused(("DeepSpeedStrategy",), "L6"), fsdp=refused(("FSDPStrategy",), "L6"))
_NOT_DDP = "use distkit's own loop (distkit.init) or distkit train"

ROWS: list[Row] = [
    # -- Lightning Trainer -------------------------------------------------------------------------------------------
    row(LIGHTNING, "`fit`: final parameters and buffers (`state_dict`; BoringModel's `Linear` has no buffers)", "grad",
        DDPSTRATEGY, ddp=close("L1"), mpi=close("L2"), horovod=close("L2")),
    row(LIGHTNING, "`fit`: final parameters and buffers (`state_dict`; plain, and DiLoCo + 2 fragments + int8 + "
        "overlap 1)", "param", OWN_LOOP, ddp=close("L3"), mpi=close("L2"), horovod=close("L2")),
    row(LIGHTNING, "`accumulate_grad_batches=2` + `gradient_clip_val=0.05`: final parameters", "grad", DDPSTRATEGY,
        ddp=close("L1"), mpi=close("L2"), horovod=close("L2")),
    row(LIGHTNING, "`accumulate_grad_batches=2` + `gradient_clip_val=0.05`: final parameters", "param", OWN_LOOP,
        ddp=close("L3"), mpi=close("L2"), horovod=close("L2")),
    row(LIGHTNING, "BatchNorm, steps calling `self.model(x)`: `valid_loss` logged during `fit` (rank 0's statistics "
        "before validation) and final parameters", "grad", DDPSTRATEGY, ddp=close("L1"), mpi=close("L2"),
        horovod=close("L2")),
    row(LIGHTNING, "BatchNorm, steps calling `self.model(x)`: `valid_loss` logged during `fit` (both validations "
        "between syncs: each rank's own replica and statistics, the mean over the ranks) and final parameters and "
        "buffers",
        "param", OWN_LOOP, ddp=close("L3"), mpi=close("L2"), horovod=close("L2")),
    row(LIGHTNING, "torchmetrics `MeanMetric` logged with `self.log(name, metric)`", "grad",
        "DDP's value (0.5, the mean over both ranks)", ddp=identical("L1"), mpi=identical("L4"),
        horovod=identical("L4")),
    row(LIGHTNING, "torchmetrics `MeanMetric` logged with `self.log(name, metric)`", "param",
        "DDP's value (0.5, the mean over both ranks)", ddp=identical("L3"), mpi=identical("L4"),
        horovod=identical("L4")),
    row(LIGHTNING, "`self.log(..., sync_dist=True)` in `validation_step`/`test_step`: what `trainer.validate` and "
        "`trainer.test` return after `fit`", "grad", CLOSED_FORM, ddp=close("L1"), mpi=close("L2", "L7"),
        horovod=close("L2")),
    row(LIGHTNING, "`self.log(..., sync_dist=True)` in `validation_step`/`test_step`: what `trainer.validate` and "
        "`trainer.test` return after `fit`", "param", CLOSED_FORM, ddp=close("L3"), mpi=close("L2"),
        horovod=close("L2")),
    row(LIGHTNING, "`trainer.validate` without `fit`, each rank's weights its own: rank 0's evaluated", "grad",
        CLOSED_FORM, ddp=close("L1"), mpi=close("L2"), horovod=close("L2")),
    row(LIGHTNING, "`trainer.validate` without `fit`, each rank's weights its own: rank 0's evaluated", "param",
        CLOSED_FORM, ddp=close("L3"), mpi=close("L2"), horovod=close("L2")),
    row(LIGHTNING, "`trainer.predict` outputs", "grad", DDPSTRATEGY, ddp=close("L1"), mpi=close("L2"),
        horovod=close("L2")),
    row(LIGHTNING, "`trainer.predict` outputs", "param", OWN_LOOP, ddp=close("L3"), mpi=close("L2"),
        horovod=close("L2")),
    row(LIGHTNING, "per-step LR schedule (`'interval': 'step'`): every step's rate (asserted equal) and final "
        "parameters", "grad", DDPSTRATEGY, ddp=close("L1"), mpi=close("L2"), horovod=close("L2")),
    row(LIGHTNING, "per-step LR schedule (`'interval': 'step'`) with the accumulation and clipping above: every "
        "step's rate (asserted equal) and final parameters", "param", OWN_LOOP, ddp=close("L3"), mpi=close("L2"),
        horovod=close("L2")),
    row(LIGHTNING, "per-epoch `StepLR` resumed from `DDPStrategy`'s first-epoch checkpoint: every step's rate "
        "(asserted equal) and final parameters", "grad", "`DDPStrategy`'s resume from the same file",
        ddp=close("L1"), mpi=close("L2"), horovod=close("L2")),
    row(LIGHTNING, "per-epoch `StepLR` across a resume (`fit(ckpt_path=epoch=0.ckpt)` + each rank's sidecar, "
        "mid-period): every step's rate (asserted equal), the uninterrupted and the resumed run's final parameters",
        "param", OWN_LOOP, ddp=close("L3"), mpi=close("L2"), horovod=close("L2")),
    row(LIGHTNING, "best checkpoint (`ModelCheckpoint(monitor=...)`, `best_model_path`)", "grad", DDPSTRATEGY,
        ddp=close("L1"), mpi=close("L2"), horovod=close("L2")),
    row(LIGHTNING, "best checkpoint (`ModelCheckpoint(monitor=...)`, `best_model_path`; the BatchNorm model above: "
        "the best epoch, its score, rank 0's replica in the file)", "param", OWN_LOOP, ddp=close("L3"), mpi=close("L2"),
        horovod=close("L2")),
    row(LIGHTNING, "`ModelCheckpoint` + `fit(ckpt_path=epoch=0.ckpt)` (param: + each rank's sidecar)", "grad",
        UNINTERRUPTED, ddp=close("L1"), mpi=close("L2"), horovod=close("L2")),
    row(LIGHTNING, "`ModelCheckpoint` + `fit(ckpt_path=epoch=0.ckpt)` (param: + each rank's sidecar)", "param",
        UNINTERRUPTED, ddp=close("L3"), mpi=close("L2"), horovod=close("L2")),
    row(LIGHTNING, "dropout, `ModelCheckpoint(save_on_train_epoch_end=False)`, the same resume (from `DDPStrategy`'s "
        "first-epoch file: grad mode's checkpoints hold no random state, and `DDPStrategy`'s own resume is not the "
        "uninterrupted run)", "grad", "`DDPStrategy`'s resume from the same file", ddp=close("L1"), mpi=close("L2"),
        horovod=close("L2")),
    row(LIGHTNING, "dropout, `ModelCheckpoint(save_on_train_epoch_end=False)`, the same resume", "param",
        UNINTERRUPTED, ddp=identical("L3"), mpi=identical("L2"), horovod=identical("L2")),
    row(LIGHTNING, "resume after a kill (a rank killed during `fit`): rank 1 SIGKILLed in epoch 3, then "
        "`fit(ckpt_path=\"last\")` (`ModelCheckpoint(save_last=True)`; param: + each rank's sidecar, mid-period)",
        "grad", UNINTERRUPTED, ddp=identical("K1"), mpi=identical("K2"), horovod=identical("K3")),
    row(LIGHTNING, "resume after a kill (a rank killed during `fit`): rank 1 SIGKILLed in epoch 3, then "
        "`fit(ckpt_path=\"last\")` (`ModelCheckpoint(save_last=True)`; param: + each rank's sidecar, mid-period)",
        "param", UNINTERRUPTED, ddp=identical("K1"), mpi=identical("K2"), horovod=identical("K3")),
    row(LIGHTNING, "LightningCLI: `--trainer.strategy distkit` (distkit's defaults: the ddp engine) and the class path "
        "with `--trainer.strategy.source` (a JSON dict; mpi, horovod: naming the engine)", "grad",
        "LightningCLI's `--trainer.strategy ddp` (`DDPStrategy`)", ddp=identical("L1"), mpi=close("L2"),
        horovod=close("L2")),
    row(LIGHTNING, "engine choice (`distributed.backend`)", "grad", REFUSAL, ddp=runs("L1"), mpi=runs("L2"),
        horovod=runs("L2"), **_LIGHTNING_ENGINES),
    row(LIGHTNING, "engine choice (`distributed.backend`)", "param", REFUSAL, ddp=runs("L3"), mpi=runs("L2"),
        horovod=runs("L2")),
    row(LIGHTNING, "`Trainer(devices=2)` alone, no `--nprocs` or `mpirun`", "grad", REFUSAL, ddp=runs("L1"),
        mpi=refused(("--nprocs 2", "mpirun -np 2"), "L6"), horovod=refused(("--nprocs 2", "mpirun -np 2"), "L6")),
    row(LIGHTNING, "manual optimization (`automatic_optimization = False`)", "grad", REFUSAL,
        ddp=refused(("DDPStrategy",), "L6"), mpi=refused(("DDPStrategy",), "L6"),
        horovod=refused(("DDPStrategy",), "L6")),
    row(LIGHTNING, "`precision='16-mixed'` (a GradScaler)", "grad", REFUSAL, ddp=refused(("bf16-mixed",), "L6"),
        mpi=refused(("bf16-mixed",), "L6"), horovod=refused(("bf16-mixed",), "L6")),
    row(LIGHTNING, "distkit's own `precision` key", "grad", REFUSAL, ddp=refused(("on the Trainer or Fabric",), "L6"),
        mpi=refused(("on the Trainer or Fabric",), "L6"), horovod=refused(("on the Trainer or Fabric",), "L6")),
    # -- Lightning Fabric --------------------------------------------------------------------------------------------
    row(FABRIC, "`fabric.setup`, `setup_dataloaders`, `backward`, `optimizer.step`: final parameters and buffers "
        "(a `Linear`: no buffers)", "grad", FABRIC_DDP, ddp=close("L5"), mpi=close("L2"), horovod=close("L2")),
    row(FABRIC, "`fabric.setup`, `setup_dataloaders`, `backward`, `optimizer.step`: final parameters and buffers "
        "(a `Linear`: no buffers)", "param", OWN_LOOP, ddp=close("L5"), mpi=close("L2"), horovod=close("L2")),
    row(FABRIC, "`fabric.all_reduce` (mean, sum, an integer mean; in place)", "grad", "the values Fabric's own `ddp` "
        "gives", ddp=identical("L5"), mpi=identical("L2"), horovod=identical("L2")),
    row(FABRIC, "`fabric.all_reduce` (mean, sum, an integer mean; in place)", "param", "the values Fabric's own `ddp` "
        "gives", ddp=identical("L5"), mpi=identical("L2"), horovod=identical("L2")),
    row(FABRIC, "accumulation (`fabric.no_backward_sync`) + `fabric.clip_gradients`", "grad", FABRIC_DDP,
        ddp=close("L5"), mpi=close("L2"), horovod=close("L2")),
    row(FABRIC, "accumulation (`fabric.no_backward_sync`) + `fabric.clip_gradients`", "param", OWN_LOOP,
        ddp=close("L5"), mpi=close("L2"), horovod=close("L2")),
    row(FABRIC, "torchmetrics `Metric` of the set-up module", "grad", "DDP's value (0.5, the mean over both ranks)",
        ddp=identical("L5"), mpi=identical("L4"), horovod=identical("L4")),
    row(FABRIC, "torchmetrics `Metric` of the set-up module", "param", "DDP's value (0.5, the mean over both ranks)",
        ddp=identical("L5"), mpi=identical("L4"), horovod=identical("L4")),
    row(FABRIC, "per-step LR scheduler stepped by the loop, with the accumulation and clipping above: every step's "
        "rate (asserted equal) and final parameters", "grad", FABRIC_DDP, ddp=close("L5"), mpi=close("L2"),
        horovod=close("L2")),
    row(FABRIC, "per-step LR scheduler stepped by the loop, with the accumulation and clipping above: every step's "
        "rate (asserted equal) and final parameters", "param", OWN_LOOP, ddp=close("L5"), mpi=close("L2"),
        horovod=close("L2")),
    row(FABRIC, "evaluation between syncs (after 8 steps, syncs every 3): the set-up model in `eval()` without "
        "gradients on this rank's share, the loss's `fabric.all_reduce` (each rank's own replica)", "param", OWN_LOOP,
        ddp=close("L5"), mpi=close("L2"), horovod=close("L2")),
    row(FABRIC, "`fabric.save` after epoch 1, `fabric.load` + epoch 2 (param: + each rank's sidecar)", "grad",
        UNINTERRUPTED, ddp=close("L5"), mpi=close("L2"), horovod=close("L2")),
    row(FABRIC, "`fabric.save` after epoch 1, `fabric.load` + epoch 2 (param: + each rank's sidecar)", "param",
        UNINTERRUPTED, ddp=close("L5"), mpi=close("L2"), horovod=close("L2")),
    row(FABRIC, "resume after a kill: rank 1 SIGKILLed in epoch 3, then `fabric.load` of the `fabric.save` of each "
        "epoch's end (param: + each rank's sidecar, mid-period)", "grad", UNINTERRUPTED, ddp=identical("K4"),
        mpi=identical("K5"), horovod=identical("K6")),
    row(FABRIC, "resume after a kill: rank 1 SIGKILLed in epoch 3, then `fabric.load` of the `fabric.save` of each "
        "epoch's end (param: + each rank's sidecar, mid-period)", "param", UNINTERRUPTED, ddp=identical("K4"),
        mpi=identical("K5"), horovod=identical("K6")),
    row(FABRIC, "engine choice (`distributed.backend`; the `DistkitStrategy` Fabric is given)", "grad", REFUSAL,
        ddp=runs("L5"), mpi=runs("L2"), horovod=runs("L2"), **_LIGHTNING_ENGINES),
    row(FABRIC, "engine choice (`distributed.backend`; the `DistkitStrategy` Fabric is given)", "param", REFUSAL,
        ddp=runs("L5"), mpi=runs("L2"), horovod=runs("L2")),
    row(FABRIC, "distkit's own `precision` key", "grad", REFUSAL, ddp=refused(("on the Trainer or Fabric",), "L6"),
        mpi=refused(("on the Trainer or Fabric",), "L6"), horovod=refused(("on the Trainer or Fabric",), "L6")),
    # -- transformers.Trainer ----------------------------------------------------------------------------------------
    row(TRAINER, "`train()`: final parameters and buffers (`state_dict`; tiny GPT-2, dropout 0.1)", "grad", STOCK,
        ddp=close("H1")),
    row(TRAINER, "`train()`: final parameters and buffers (`state_dict`; tiny GPT-2, dropout 0.1 (the Trainer's "
        "masks replayed), outer Nesterov, 2 fragments, int8, overlap 1, `max_grad_norm` 1.0)", "param", OWN_ON_BATCHES,
        ddp=identical("H2")),
    row(TRAINER, "`gradient_accumulation_steps=2` + the default `max_grad_norm=1.0` clipping", "grad", STOCK,
        ddp=close("H1")),
    row(TRAINER, "`gradient_accumulation_steps=2` + clipping (`max_grad_norm=0.6`, acting on most steps)", "param",
        OWN_ON_BATCHES, ddp=identical("H11")),
    row(TRAINER, "`bf16=True` in `TrainingArguments` (Accelerate's autocast), evaluated during `train()`: final "
        "parameters, `log_history`", "grad", STOCK, ddp=close("H1")),
    row(TRAINER, "per-step LR schedule (the Trainer's default linear decay)", "grad", STOCK, ddp=close("H1")),
    row(TRAINER, "per-step LR schedule (the Trainer's default linear decay): every step's logged rate, final "
        "parameters", "param", OWN_ON_BATCHES, ddp=identical("H11")),
    row(TRAINER, "logged training loss (`log_history`: every step's loss, `grad_norm`, `learning_rate`; "
        "`eval_loss`; `train_loss`; no other metric)", "grad", STOCK, ddp=close("H1")),
    row(TRAINER, "logged training loss (`log_history`: every step's loss (the mean over the ranks), this rank's "
        "`grad_norm`, `learning_rate`; `train_loss`)", "param", OWN_ON_BATCHES, ddp=identical("H11")),
    row(TRAINER, "`evaluate()` during and after `train()`", "grad", STOCK, ddp=close("H1")),
    row(TRAINER, "`evaluate()` between syncs: the mean of the replicas", "param",
        "the best checkpoint's model (the replicas' mean) and `best_metric`", ddp=identical("H3", "H4")),
    row(TRAINER, "`predict()` outputs", "grad", STOCK, ddp=close("H1")),
    row(TRAINER, "`predict()` outputs", "param", OWN_ON_BATCHES, ddp=identical("H11")),
    row(TRAINER, "`load_best_model_at_end`: the best checkpoint, the model every rank ends with", "grad", STOCK,
        ddp=close("H1")),
    row(TRAINER, "`load_best_model_at_end`: the best checkpoint, the model every rank ends with", "param",
        "the replicas' mean at the best step; `evaluate()` = `best_metric`", ddp=identical("H3", "H4")),
    row(TRAINER, "`train(resume_from_checkpoint=checkpoint-4)` in new processes (param: mid-period, an exchange in "
        "flight)", "grad", UNINTERRUPTED, ddp=identical("H10")),
    row(TRAINER, "`train(resume_from_checkpoint=checkpoint-4)` in new processes (param: mid-period, an exchange in "
        "flight)", "param", UNINTERRUPTED, ddp=identical("H2")),
    row(TRAINER, "dropout, the same resume", "grad", UNINTERRUPTED, ddp=identical("H10")),
    row(TRAINER, "dropout, the same resume", "param", UNINTERRUPTED, ddp=identical("H2")),
    row(TRAINER, "resume after a kill: rank 1 SIGKILLed at step 6, then `train(resume_from_checkpoint=True)` "
        "(checkpoint-4; dropout; param: mid-period, an exchange in flight): final parameters, rank 0's `log_history`",
        "grad", UNINTERRUPTED, ddp=identical("K7")),
    row(TRAINER, "resume after a kill: rank 1 SIGKILLed at step 6, then `train(resume_from_checkpoint=True)` "
        "(checkpoint-4; dropout; param: mid-period, an exchange in flight): final parameters, rank 0's `log_history`",
        "param", UNINTERRUPTED, ddp=identical("K7")),
    row(TRAINER, "engine choice (`distkit=` or `++distributed.backend`)", "grad", REFUSAL, ddp=runs("H1"),
        mpi=refused(("not 'mpi'", _NOT_DDP), "H5", "H6"), horovod=refused(("not 'horovod'", _NOT_DDP), "H5", "H6"),
        deepspeed=refused(("TrainingArguments(deepspeed=...)",), "H5"),
        fsdp=refused(("TrainingArguments(fsdp=...)",), "H5")),
    row(TRAINER, "engine choice (`distkit=` or `++distributed.backend`)", "param", REFUSAL, ddp=runs("H2")),
    row(TRAINER, "`fp16=True` in `TrainingArguments`", "grad", REFUSAL,
        ddp=refused(("remove fp16 from TrainingArguments (bf16=True works)",), "H5")),
    row(TRAINER, "`mpirun` with no `MASTER_ADDR`", "grad", REFUSAL,
        ddp=refused(("launch with torchrun --nproc_per_node 2 (or accelerate launch)",), "H6")),
    # -- Accelerate loop (param mode only) ---------------------------------------------------------------------------
    row(PARAMSYNC, "final parameters and buffers (BatchNorm + dropout MLP, `local_sgd_steps=3`, one instance over 2 "
        "epochs; buffers each rank's own, as `LocalSGD` leaves them)", "param", LOCALSGD, ddp=identical("H7")),
    row(PARAMSYNC, "per-step LR schedule: Accelerate's example (`examples/hf_local_sgd.py`: AdamW, linear warmup "
        "stepped every step, dropout, a `ParamSync` per epoch)", "param", "the same file with `LocalSGD`",
        ddp=identical("H7")),
    row(PARAMSYNC, "outer Nesterov + 2 fragments + int8 + overlap 1: parameters and BatchNorm buffers", "param",
        "distkit's own loop (same keys, per-rank batches)", ddp=identical("H8")),
    row(PARAMSYNC, "`accelerator.accumulate` + gradient clipping (`clip_grad_norm_`, acting at every step): final "
        "parameters and buffers, every pre-clip norm", "param", LOCALSGD, ddp=identical("H7")),
    row(PARAMSYNC, "evaluation after the block (`gather_for_metrics`): predictions and loss", "param", LOCALSGD,
        ddp=identical("H7")),
    row(PARAMSYNC, "`accelerator.save_state` mid-period (plain; extras with an exchange in flight), `load_state` in "
        "new processes", "param", UNINTERRUPTED, ddp=identical("H9")),
    row(PARAMSYNC, "dropout, the same resume", "param", UNINTERRUPTED, ddp=identical("H9")),
    row(PARAMSYNC, "resume after a kill: rank 1 SIGKILLed at step 9, then `accelerator.load_state()` of the newest "
        "automatically named `save_state` (an exchange in flight; dropout, BatchNorm): parameters and buffers", "param",
        UNINTERRUPTED, ddp=identical("K8")),
    row(PARAMSYNC, "engine choice (`config=`)", "param", REFUSAL, ddp=runs("H7"),
        mpi=refused(("distributed.backend must be 'ddp'",), "H7")),
    # -- SpeechBrain Brain -------------------------------------------------------------------------------------------
    # (ZeRO-2 is compared with SpeechBrain's clipping and accumulation off, against the reference run with them off:
    # a row of its own would leave four cells that row 1 already holds with them on)
    row(SPEECHBRAIN, "SpeechBrain's ASR_CTC example (BatchNorm, LiGRU, dropout, InputNormalization, clipping at 5, "
        "`grad_accumulation_factor` 2; on ZeRO-2 both off, against the reference with both off: DeepSpeed clips and "
        "accumulates in its partitions, 1.6e-2 and 9.2e-3 with them, docs/integrations.md), `fit` + `evaluate`: the "
        "checkpoint files, `train_log.txt`, every rank's final model", "grad", SB_DDP, ddp=identical("S1"),
        mpi=identical("S2"), horovod=identical("S3"), deepspeed=identical("S5"), fsdp=identical("S4")),
    row(SPEECHBRAIN, "ASR_CTC in param mode (every 4th step averaged, intra-epoch checkpoints, SpeechBrain's clipping "
        "off): every rank's final model, the last checkpoint's files, `train_log.txt` (validation on the replicas' "
        "mean)", "param", "the same recipe on the ddp engine", ddp=reference("S6", "S15"), mpi=identical("S6"),
        horovod=identical("S15"), deepspeed=identical("S15"), fsdp=identical("S15")),
    row(SPEECHBRAIN, "a rank killed mid-epoch, then the same command (`recover_if_possible`; dropout off: the LiGRU's "
        "mask position is in no checkpoint)", "param", UNINTERRUPTED, ddp=identical("S10"), mpi=identical("S17"),
        horovod=identical("S17"), deepspeed=identical("S17"), fsdp=identical("S17")),
    row(SPEECHBRAIN, "speaker_id in DiLoCo from a `distributed:` block in the hparams YAML: ranks in sync, one writer",
        "param", REFUSAL, ddp=runs("S16"), mpi=runs("S16"), horovod=runs("S7"), deepspeed=runs("S16"),
        fsdp=runs("S16")),
    row(SPEECHBRAIN, "engine choice (`++distributed.backend`, `++use_horovod True`, a `distributed:` block)", "grad",
        REFUSAL, ddp=runs("S1"), mpi=runs("S2"), horovod=runs("S3"), deepspeed=runs("S5"), fsdp=runs("S4")),
    row(SPEECHBRAIN, "`--data_parallel_backend`; an epoch's batch count not a multiple of "
        "`grad_accumulation_factor`", "grad", REFUSAL,
        ddp=refused(("--data_parallel_backend", "grad_accumulation_factor"), "S8", "S9"),
        mpi=refused(("--data_parallel_backend", "grad_accumulation_factor"), "S11"),
        horovod=refused(("--data_parallel_backend", "grad_accumulation_factor"), "S12"),
        deepspeed=refused(("--data_parallel_backend", "grad_accumulation_factor"), "S13"),
        fsdp=refused(("--data_parallel_backend", "grad_accumulation_factor"), "S14")),
]


def render_table() -> str:
    """The markdown table of :data:`ROWS`, then the list of the tests its cells cite (what docs/integrations.md
    shows)."""
    head = "| front door | idiom | mode | compared with | " + " | ".join(ENGINES) + " |"
    lines = [head, "|" + "---|" * (len(ENGINES) + 4)]
    for r in ROWS:
        lines.append(f"| {r.door} | {r.idiom} | {r.mode} | {r.compared_with} | "
                     + " | ".join(r.cells[e].shown() for e in ENGINES) + " |")
    lines.append("")
    lines.append("Tests cited:")
    lines.append("")
    lines += [f"- {label}: `{node}`" for label, node in TESTS.items()]
    return "\n".join(lines) + "\n"
