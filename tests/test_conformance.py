"""The conformance suite: one script of everyday idioms (tests/conformance/idioms.py) on every engine and mode.

For each idiom and engine the outcome is DDP's result (every parameter and learning rate within
``TOL`` of the DDP run's, phase by phase, on every rank), or the documented error (a one-line
DistkitError whose text names the fix). ``EXPECTED`` is the table; ``docs/api.md`` shows it, and
:func:`test_api_md_shows_the_table_this_suite_proves` keeps the two equal.

Cost: one process start per engine and mode for the "main" run kind (the fast tier's parity row), one for its other
kinds together (:func:`chained`; Horovod, and DeepSpeed in grad mode: one each) and one for each kind refused at
set-up; each start runs many idioms in a row.
"""
from __future__ import annotations

import functools
import json
import pickle
import re
import subprocess
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

import tiers  # (a hand-written tier reason is one of its constants: an unknown one makes the test serial)
from conftest import BIN, ROOT, run
from distkit.backends import REGISTRY

SCRIPT = str(ROOT / "tests" / "conformance" / "idioms.py")
PY = str(BIN / "python")
TOL = 1e-5  # DeepSpeed's fp32 masters may round differently from DDP; seen: bit-identical on this machine

#: the engines' variants the suite runs: every registered engine by its name (so a new engine gets every row by
#: itself), DeepSpeed as two ZeRO stages
VARIANTS: dict[str, dict[str, str]] = {
    "deepspeed": {"zero2": "'backend': 'deepspeed', 'deepspeed_config': {'zero_optimization': {'stage': 2}}",
                  "zero3": "'backend': 'deepspeed', 'deepspeed_config': {'zero_optimization': {'stage': 3}}"},
}
ENGINES: dict[str, str] = {v: d for e in REGISTRY for v, d in VARIANTS.get(e, {e: f"'backend': '{e}'"}).items()}
MODES = {"grad": "", "param": ", 'reduce_type': 'param', 'param_sync_step': 3"}
FIND_UNUSED = ", 'options': {'find_unused_parameters': True}"

#: run kind -> (script phases, script flags, distributed-dict suffix)
RUNS: dict[str, tuple[list[str], list[str], str]] = {
    "main": (["plain", "zero_grad_set_to_none", "save_load", "drop_last", "eval_between_steps", "eval_gather",
              "module_attribute", "ema", "double_backward", "raw_clip", "distributed_sampler"], [], ""),
    # accumulation set after init (dk.set_accumulation), a scheduler factory
    "accum": (["plain", "accumulate_without_no_sync", "save_load"], ["--accum-api", "2", "--scheduler", "factory"], ""),
    "compile": (["save_load"], ["--compile"], ""),
    "unused": (["plain", "save_load", "some_ranks"], ["--unused"], FIND_UNUSED),
    "unused_no_find": (["plain"], ["--unused"], ""),
    # DiLoCo (param mode only): Nesterov outer steps at every step's sync, where momentum extrapolated BatchNorm's
    # running statistics before issue 57 E (they are averaged, never stepped)
    "diloco": (["plain", "eval_between_steps"], [],
               ", 'param_sync_step': 1, 'outer_optimizer': {'class': 'nesterov', 'lr': 0.7, 'momentum': 0.9}"),
    # issue 60's low-communication keys (param mode only): a sync every 2 steps, so every phase ends on a sync; the
    # codec's per-rank state (error feedback) through dk.save + dk.load, then the final sync of dk.finish
    "int4": (["save_load", "synced"], [], ", 'param_sync_step': 2, 'param_sync_compression': 'int4'"),
    "e3m0": (["save_load", "synced"], [], ", 'param_sync_step': 2, 'param_sync_compression': 'e3m0'"),
    "topk": (["save_load", "synced"], [], ", 'param_sync_step': 2, 'param_sync_compression': 'topk', "
             "'param_sync_topk_density': 0.03125, 'param_sync_topk_bits': 2, 'param_sync_topk_chunk': 256"),
    # MuLoCo: Muon (+ AdamW) as the inner optimizer under DiLoCo's outer one
    "muon": (["save_load", "synced"], ["--optimizer", "muon"],
             ", 'param_sync_step': 2, 'outer_optimizer': {'class': 'nesterov', 'lr': 0.7, 'momentum': 0.9}"),
}

SAME = "same"
MUON_REFUSED = "use backend 'ddp', 'mpi', 'horovod' or 'fsdp' for Muon"
#: run kind -> bytes per sync each rank hands to its engine's collectives (the averager's ``sync_bytes`` over its
#: syncs), by hand: the model's 792 parameter elements (772 trainable: DeepSpeed's masters; the same sizes once padded)
#: and BatchNorm's 64 floating buffer elements, which go as fp32 (256 bytes), on 2 ranks
SYNC_BYTES = {
    "int4": 3 * (512 // 2 + 4 * 4) + 256,  # p + 1 chunks of 4 blocks of 128 (792 padded to 1024) at 4 bits + scales
    "e3m0": 3 * (512 // 2 + 4 * 4) + 256,  # int4's layout: 4-bit codes, one fp32 scale per block of 128
    "topk": 4 * (2 * 8 + 2 + 4) + 256,  # 4 chunks of 256, 8 kept each: 8 int16 indices, 8 2-bit values, a scale
    "muon": 4 * (792 + 64),  # fp32: the parameters and buffers in one all-reduce
}
# idiom -> engine -> SAME or the documented error (a phrase of its one line); the run and phase that prove it.
# Every idiom is checked in both modes unless its row says "grad" or "param".
EXPECTED: dict[str, dict[str, str]] = {
    "accumulation with no_sync (dk.set_accumulation(2) after init; grad)": dict.fromkeys(ENGINES, SAME),
    "accumulation: every backward outside no_sync (grad)": dict.fromkeys(ENGINES, SAME),
    "two backward passes per step, accumulation not set": {
        "ddp": SAME, "mpi": SAME, "horovod": SAME, "fsdp": SAME,
        "zero2": "takes exactly accum_grad_multiple_step", "zero3": "takes exactly accum_grad_multiple_step"},
    "torch.nn.utils.clip_grad_norm_ kept in the script": {
        "ddp": SAME, "mpi": SAME, "horovod": SAME, "fsdp": SAME,
        "zero2": "set gradient_clip", "zero3": "set gradient_clip"},
    "optimizer.zero_grad(set_to_none=True)": dict.fromkeys(ENGINES, SAME),
    "AdamW weight-decay groups, dk.save + dk.load, LR scheduler object": dict.fromkeys(ENGINES, SAME),
    "LR scheduler factory across dk.save + dk.load (grad)": dict.fromkeys(ENGINES, SAME),
    "torch.compile(model) before dk.setup (checkpoint names without _orig_mod.; grad)": {
        "ddp": SAME, "mpi": SAME, "horovod": SAME, "zero2": SAME, "zero3": "pass the uncompiled model to dk.setup",
        "fsdp": SAME},
    "EMA copy (AveragedModel) with dk.keep_in_sync": {
        "ddp": SAME, "mpi": SAME, "horovod": SAME, "zero2": SAME, "zero3": "build the copy inside", "fsdp": SAME},
    "model.module (grad mode; param mode has no wrapper on any engine)": {
        "ddp": SAME, "mpi": "use dk.unwrap(model)", "horovod": "use dk.unwrap(model)", "zero2": SAME, "zero3": SAME,
        "fsdp": "use dk.unwrap(model)"},
    "unused parameter, find_unused_parameters = True (grad)": {
        "ddp": SAME, "mpi": SAME, "horovod": SAME, "fsdp": SAME,
        "zero2": "freeze them (requires_grad_(False))", "zero3": "freeze them (requires_grad_(False))"},
    "a module some ranks run and others not in a step, find_unused_parameters = True (grad)": {
        "ddp": SAME, "mpi": SAME, "horovod": SAME, "fsdp": "the ranks run different modules in this step",
        "zero2": "the ranks run different modules in this step", "zero3": "the ranks run different modules in this step"},
    "unused parameter without find_unused_parameters (ddp: torch's own error; grad)": {
        "ddp": "(torch)", "mpi": "set distributed.options = {'find_unused_parameters': True}",
        "horovod": "set distributed.options = {'find_unused_parameters': True}",
        "fsdp": "set distributed.options = {'find_unused_parameters': True}",
        "zero2": "freeze them (requires_grad_(False))", "zero3": "freeze them (requires_grad_(False))"},
    "torch.utils.data.DistributedSampler(dataset) kept": {
        "ddp": SAME, "mpi": "pass the dataset to dk.dataloader", "horovod": "pass the dataset to dk.dataloader",
        "zero2": SAME, "zero3": SAME, "fsdp": SAME},
    "dk.dataloader(..., drop_last=True), dk.print(..., flush=True)": dict.fromkeys(ENGINES, SAME),
    "BatchNorm model: evaluation (model.eval(), torch.no_grad()) between training steps": dict.fromkeys(ENGINES, SAME),
    "evaluation loader with drop_last=False (given, or a re-sharded DataLoader's), dk.gather per batch of per-sample outputs and losses (gather_for_metrics)": dict.fromkeys(ENGINES, SAME),
    "DiLoCo outer optimizer on a BatchNorm model, evaluation between steps (param)": dict.fromkeys(ENGINES, SAME),
    # (DeepSpeed's blocks: its masters per parameter in the model's order, as every engine's; issue 60)
    "param_sync_compression = 'int4', dk.save + dk.load between syncs, dk.finish (param)": dict.fromkeys(ENGINES, SAME),
    "param_sync_compression = 'e3m0' (4-bit float), dk.save + dk.load between syncs, dk.finish (param)":
        dict.fromkeys(ENGINES, SAME),
    "param_sync_compression = 'topk' (density 1/32, 2-bit values), dk.save + dk.load between syncs, dk.finish (param)":
        dict.fromkeys(ENGINES, SAME),
    "optimizer = {'class': 'muon'} under DiLoCo's outer optimizer, dk.save + dk.load, dk.finish (param)": {
        "ddp": SAME, "mpi": SAME, "horovod": SAME, "zero2": MUON_REFUSED, "zero3": MUON_REFUSED, "fsdp": SAME},
}
#: idiom -> (run kind, phase)
WHERE: dict[str, tuple[str, str]] = {
    "accumulation with no_sync (dk.set_accumulation(2) after init; grad)": ("accum", "plain"),
    "accumulation: every backward outside no_sync (grad)": ("accum", "accumulate_without_no_sync"),
    "two backward passes per step, accumulation not set": ("main", "double_backward"),
    "torch.nn.utils.clip_grad_norm_ kept in the script": ("main", "raw_clip"),
    "optimizer.zero_grad(set_to_none=True)": ("main", "zero_grad_set_to_none"),
    "AdamW weight-decay groups, dk.save + dk.load, LR scheduler object": ("main", "save_load"),
    "LR scheduler factory across dk.save + dk.load (grad)": ("accum", "save_load"),
    "torch.compile(model) before dk.setup (checkpoint names without _orig_mod.; grad)": ("compile", "save_load"),
    "EMA copy (AveragedModel) with dk.keep_in_sync": ("main", "ema"),
    "model.module (grad mode; param mode has no wrapper on any engine)": ("main", "module_attribute"),
    "unused parameter, find_unused_parameters = True (grad)": ("unused", "save_load"),
    "a module some ranks run and others not in a step, find_unused_parameters = True (grad)": ("unused", "some_ranks"),
    "unused parameter without find_unused_parameters (ddp: torch's own error; grad)": ("unused_no_find", "plain"),
    "torch.utils.data.DistributedSampler(dataset) kept": ("main", "distributed_sampler"),
    "dk.dataloader(..., drop_last=True), dk.print(..., flush=True)": ("main", "drop_last"),
    "BatchNorm model: evaluation (model.eval(), torch.no_grad()) between training steps": ("main", "eval_between_steps"),
    "evaluation loader with drop_last=False (given, or a re-sharded DataLoader's), dk.gather per batch of per-sample outputs and losses (gather_for_metrics)": ("main", "eval_gather"),
    "DiLoCo outer optimizer on a BatchNorm model, evaluation between steps (param)": ("diloco", "eval_between_steps"),
    "param_sync_compression = 'int4', dk.save + dk.load between syncs, dk.finish (param)": ("int4", "synced"),
    "param_sync_compression = 'e3m0' (4-bit float), dk.save + dk.load between syncs, dk.finish (param)":
        ("e3m0", "synced"),
    "param_sync_compression = 'topk' (density 1/32, 2-bit values), dk.save + dk.load between syncs, dk.finish (param)":
        ("topk", "synced"),
    "optimizer = {'class': 'muon'} under DiLoCo's outer optimizer, dk.save + dk.load, dk.finish (param)":
        ("muon", "synced"),
}
GRAD_ONLY = {"accum", "compile", "unused", "unused_no_find"}
#: (muon's grad mode on every engine: tests/test_muon.py, whose runs are the Trainer's with the config key)
PARAM_ONLY = {"diloco", "int4", "e3m0", "topk", "muon"}


def argv(engine: str, mode: str, kind: str, out: str) -> list[str]:
    """The idioms script's command line (after the script) of one run kind on ``engine`` in ``mode``, 2 ranks."""
    phases, flags, suffix = RUNS[kind]
    dist = "{" + ENGINES[engine] + MODES[mode] + suffix + "}"
    return ["--out", out, "--phases", ",".join(phases), *flags, "--nprocs", "2", "++distributed", dist,
            "++progress_bar", "False"]


def records(out: str, res: Any) -> list[dict[str, Any]]:
    """Each rank's record of the run that wrote ``out`` (``res``: its launch, named where a record is unreadable)."""
    ranks = []
    for p in sorted(Path(out).glob("rank-*.pt")):
        try:
            ranks.append(torch.load(p, weights_only=False))
        except (EOFError, RuntimeError, pickle.UnpicklingError) as e:  # say what the run did, not only the file
            raise AssertionError(f"{p} unreadable ({type(e).__name__}: {e}) after the run ended with exit "
                                 f"{res.returncode}:\n{(res.stdout + res.stderr)[-3000:]}") from e
    return ranks


def outcome(res: subprocess.CompletedProcess[str], out: str) -> dict[str, Any]:
    """What a case reads of a run kind: its start's exit status and output, each rank's record in ``out``."""
    return {"rc": res.returncode, "out": res.stdout + res.stderr, "ranks": records(out, res), "dir": out}


def kind_dir(base: str, engine: str, mode: str, kind: str) -> str:
    """Where a run kind of ``engine`` in ``mode`` writes its records, alone or chained."""
    return f"{base}/{engine}-{mode}-{kind}"


@functools.lru_cache(maxsize=None)
def launch(engine: str, mode: str, kind: str, out: str) -> dict[str, Any]:
    """Run the idioms script once (2 ranks); returns exit status, output and each rank's record."""
    return outcome(run([PY, SCRIPT, *argv(engine, mode, kind, out)], timeout=240), out)


#: engine -> the modes whose run kinds share a start (:func:`chained`): where sessions can follow one another in a
#: process (every chained kind recorded what it records alone, bit for bit, when the chains came in). Not Horovod,
#: whose ``hvd.shutdown`` finalizes MPI (the next session's init aborts: exit 14), nor DeepSpeed's grad mode, whose
#: engine keeps the first session's process group (the next ZeRO engine: "Group ... is not registered"): open.
CHAINED: dict[str, tuple[str, ...]] = {"ddp": ("grad", "param"), "mpi": ("grad", "param"), "fsdp": ("grad", "param"),
                                       "zero2": ("param",), "zero3": ("param",)}
#: (engine, mode, kind) refused while the run sets up (dk.setup): the process ends there, so it starts alone
REFUSED_AT_SETUP = {("zero2", "param", "muon"), ("zero3", "param", "muon"), ("zero3", "grad", "compile")}
#: the kinds whose run may end its process (an error in the step after a refused phase), last in a chain, in this order
LAST = ("unused", "unused_no_find")


@functools.lru_cache(maxsize=None)
def chain_kinds(engine: str, mode: str) -> tuple[str, ...]:
    """The run kinds of ``engine`` and ``mode`` that one process start runs one after another (idioms.py
    ``--chain``), where :data:`CHAINED` allows: every kind a case needs but ``main`` (the fast tier's parity row, alone
    so that ``make check`` pays for no chain; on mpi and Horovod it ends with the uncaught ``distributed_sampler``)
    and those :data:`REFUSED_AT_SETUP`. A start costs more than a run kind's own steps: 26 fewer starts."""
    if mode not in CHAINED.get(engine, ()):
        return ()
    kinds = {WHERE[idiom][0] for idiom, e, m in CASES if e == engine and m == mode} - {"main"}
    kinds -= {k for e, m, k in REFUSED_AT_SETUP if (e, m) == (engine, mode)}
    return tuple(sorted(kinds, key=lambda k: (LAST.index(k) + 1 if k in LAST else 0, k)))


@functools.lru_cache(maxsize=None)
def chained(engine: str, mode: str, base: str) -> subprocess.CompletedProcess[str]:
    """One start of the idioms script running :func:`chain_kinds` in a row, each kind into ``BASE/ENGINE-MODE-KIND``
    (where :func:`launch` alone would write)."""
    kinds = chain_kinds(engine, mode)
    spec = Path(base) / f"{engine}-{mode}-chain.json"
    spec.write_text(json.dumps([argv(engine, mode, k, kind_dir(base, engine, mode, k)) for k in kinds]))
    return run([PY, SCRIPT, "--chain", str(spec)], timeout=120 + 60 * len(kinds))


@functools.lru_cache(maxsize=None)
def chained_kind(engine: str, mode: str, kind: str, base: str) -> dict[str, Any]:
    """One kind of :func:`chained`'s start, read once for all its cases (as :func:`launch` caches a start alone)."""
    return outcome(chained(engine, mode, base), kind_dir(base, engine, mode, kind))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = tmp_path_factory.mktemp("conformance")

    def get(engine: str, mode: str, kind: str) -> dict[str, Any]:
        if kind in chain_kinds(engine, mode):
            return chained_kind(engine, mode, kind, str(base))
        return launch(engine, mode, kind, kind_dir(str(base), engine, mode, kind))
    return get


def _first_error(record: dict[str, Any], upto: str) -> Optional[str]:
    """The first phase before ``upto`` that raised (later states no longer compare with DDP's)."""
    for name, phase in record["phases"].items():
        if name == upto:
            return None
        if phase["error"] is not None and not phase["error"].startswith("RuntimeError"):
            return name
    return None


def _diff(a: dict[str, Any], b: dict[str, Any], per_rank: bool = True) -> float:
    """The largest difference between two records of a phase: parameters and learning rates, and with
    ``per_rank`` what each rank holds of its own (BatchNorm's running statistics and batch count, its evaluation
    outputs), which two records of the same rank share and two ranks need not."""
    assert a["params"].keys() == b["params"].keys() and a.get("buffers", {}).keys() == b.get("buffers", {}).keys()
    d = max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])
    if not per_rank:
        return max(d, max(abs(x - y) for x, y in zip(a["lrs"], b["lrs"], strict=True)))
    d = max([d, *((a["buffers"][k] - b["buffers"][k]).abs().max().item() for k in a.get("buffers", {}))])
    assert len(a.get("eval", [])) == len(b.get("eval", []))
    d = max([d, *(abs(x - y) for x, y in zip(a.get("eval", []), b.get("eval", []), strict=True))])
    return max(d, max(abs(x - y) for x, y in zip(a["lrs"], b["lrs"], strict=True)))


def expected(idiom: str, engine: str) -> str:
    """SAME, or the documented error's phrase, for ``idiom`` on ``engine``."""
    return EXPECTED[idiom].get(engine, SAME)  # an engine a row does not name gives DDP's result


CASES = [(idiom, engine, mode) for idiom in EXPECTED for engine in ENGINES for mode in MODES
         if not (mode == "param" and (WHERE[idiom][0] in GRAD_ONLY or idiom.startswith("model.module")))
         and not (mode == "grad" and WHERE[idiom][0] in PARAM_ONLY)
         and expected(idiom, engine) != "(torch)"]


#: the core rows (the "main" run: nine idioms in one start per engine and mode) are the fast tier's parity case of
#: every engine and mode (tests/tiers.py); the other runs of other engines than DDP are in the full tier
PARITY = {"zero2": "deepspeed", "zero3": "deepspeed"}


def _case(idiom: str, engine: str, mode: str) -> Any:
    marks = [pytest.mark.parity(PARITY.get(engine, engine), mode)] if WHERE[idiom][0] == "main" else []
    return pytest.param(idiom, engine, mode, marks=marks, id=f"{engine}-{mode}-{WHERE[idiom][1]}-{WHERE[idiom][0]}")


@pytest.mark.parametrize("idiom,engine,mode", [_case(*c) for c in CASES])
def test_idiom_gives_ddp_result_or_the_documented_error(runs: Any, idiom: str, engine: str, mode: str) -> None:
    kind, phase = WHERE[idiom]
    want = expected(idiom, engine)
    got = runs(engine, mode, kind)
    if not got["ranks"] or phase not in got["ranks"][0]["phases"]:
        # the process ended before recording the phase: only an uncaught documented error may do that
        assert want != SAME, f"{engine}/{mode}: no record of {phase} (exit {got['rc']}):\n{got['out'][-3000:]}"
        assert got["rc"] == 2, f"exit {got['rc']}:\n{got['out'][-3000:]}"
        lines = [ln.lstrip("\x00") for ln in got["out"].splitlines() if want in ln]  # (mpirun's NUL padding)
        assert lines and all(ln.startswith("distkit: ") for ln in lines), got["out"][-3000:]
        assert "Traceback" not in got["out"], got["out"][-3000:]
        return
    mine = [r["phases"][phase] for r in got["ranks"]]
    assert len(mine) == 2
    if phase == "synced":  # after dk.finish's sync: every replica holds the same model, bit for bit
        assert all(p["error"] is None and p["ranks_in_sync"] is True for p in mine), [p["error"] for p in mine]
        assert _diff(mine[0], mine[1], per_rank=False) == 0.0
        assert [p["bytes_per_sync"] for p in mine] == [SYNC_BYTES[kind]] * 2  # the codec's true size, every engine
    if want != SAME:
        assert all(p["error"] is not None and want in p["error"] for p in mine), [p["error"] for p in mine]
        assert all("\n" not in p["error"] for p in mine)
        return
    assert all(p["error"] is None for p in mine), [p["error"] for p in mine]
    ref = runs("ddp", mode, kind)
    assert ref["rc"] in (0, 2) and ref["ranks"], ref["out"][-3000:]
    if _first_error(got["ranks"][0], phase) is not None:
        return  # an earlier idiom was refused (its step was not DDP's): only "no error" is comparable here
    if engine != "ddp":
        for rank, p in enumerate(mine):
            assert _diff(p, ref["ranks"][rank]["phases"][phase]) <= TOL, f"rank {rank} differs from DDP in {phase}"
    if mode == "grad" or phase in ("ema",):  # grad mode: replicas equal every step; param: after finish
        assert _diff(mine[0], mine[1], per_rank=False) == 0.0
    if phase == "eval_gather":  # every sample once, in one global order, on both ranks
        assert mine[0]["gathered"] == mine[1]["gathered"] and sorted(mine[0]["gathered"]) == list(range(21))
        assert mine[0]["resharded"] == mine[1]["resharded"] == list(range(21))  # a DataLoader's drop_last=False kept
        # the per-sample loss's mean is the one-process value: mean of (i - i/2)^2 = i^2/4 over i < 21
        assert all(p["eval"][-1] == sum(i * i / 4 for i in range(21)) / 21 for p in mine), [p["eval"][-1] for p in mine]
    if phase == "ema":
        assert torch.equal(torch.cat([t.flatten() for t in mine[0]["ema"].values()]),
                           torch.cat([t.flatten() for t in mine[1]["ema"].values()]))
        # fsdp's grad mode shards the copy over both ranks: one rank's changed shard is the one copy changed, in
        # sync (True); wherever the copy's parameters are replicated, the changed rank is out of sync
        off = engine == "fsdp" and mode == "grad"
        assert all(p["ema_in_sync"] is True and p["ema_off_in_sync"] is off and p["ema_count_off_in_sync"] is False
                   for p in mine), [{k: v for k, v in p.items() if "in_sync" in k} for p in mine]
        if engine != "ddp":
            ref_ema = ref["ranks"][0]["phases"]["ema"]["ema"]
            assert max((mine[0]["ema"][k] - ref_ema[k]).abs().max().item() for k in ref_ema) <= TOL
    if kind == "diloco":  # buffers take the plain average at every sync: a variance stays a variance
        for rank, p in enumerate(mine):
            var = p["buffers"]["bn.running_var"]
            assert var.min().item() > 0, f"rank {rank}: running_var min {var.min().item()}"
    if kind == "compile":  # the compiled model's checkpoint has the model's own names
        from distkit import portable

        names = set(portable.model_state(portable.read(str(Path(got["dir"]) / "ckpt"))))
        assert names and not any("_orig_mod" in n for n in names), sorted(names)[:5]


def _same(a: Any, b: Any, where: str) -> None:
    """``a`` and ``b`` equal bit for bit: tensors (dtype, shape, values), and dicts, lists and values within."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(set(a) ^ set(b)))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.full(tiers.SWEEP)
@pytest.mark.parametrize("engine", ["ddp", "mpi"])
def test_a_chained_run_records_what_it_records_alone(runs: Any, tmp_path: Path, engine: str) -> None:
    """A run kind chained after others in the same processes (:func:`chained`: four sessions in param mode before it,
    each with its codec's per-rank state; on ddp each with its own rendezvous store on the same MASTER_PORT) records
    what the same command line records alone, bit for bit, on every rank: no state of an earlier session reaches the
    next. (Every chained kind of every engine in :data:`CHAINED` was compared so once when the chains came in: all
    equal.)"""
    mode = "param"
    kind = chain_kinds(engine, mode)[-1]
    assert len(chain_kinds(engine, mode)) >= 4, chain_kinds(engine, mode)
    chained_run = runs(engine, mode, kind)
    alone = launch(engine, mode, kind, str(tmp_path / "alone"))
    assert chained_run["ranks"] and len(chained_run["ranks"]) == len(alone["ranks"]), (chained_run["out"][-3000:],
                                                                                      alone["out"][-3000:])
    for rank, (x, y) in enumerate(zip(chained_run["ranks"], alone["ranks"])):
        _same(x, y, f"rank {rank}")


def test_deepspeed_ranks_leave_mlflow_unloaded_until_used(runs: Any) -> None:
    """DeepSpeed runs ``import mlflow`` at its own import (its autotuner); distkit defers it (distkit.launch.lazy_import):
    0.7-0.8 s of CPU per rank where MLflow is installed, as it is here. The idioms script never uses it."""
    import importlib.util

    assert importlib.util.find_spec("mlflow") is not None
    got = runs("zero2", "grad", "main")
    assert got["ranks"] and all(r["mlflow_ran"] is False for r in got["ranks"]), got["out"][-3000:]


def test_one_process_is_plain_pytorch_even_with_an_unused_parameter(tmp_path: Path) -> None:
    """``python script.py`` (no launcher, one rank): no DDP wrapper, so the unused parameter is no error, and
    every phase equals the same phases in plain PyTorch without distkit (bit for bit)."""
    phases = "plain,zero_grad_set_to_none,raw_clip,double_backward"
    res = run([PY, SCRIPT, "--out", str(tmp_path / "dk"), "--phases", phases, "--unused", "++progress_bar", "False"])
    assert res.returncode == 0, res.stderr[-3000:]
    ref = run([PY, SCRIPT, "--out", str(tmp_path / "plain"), "--phases", phases, "--unused", "--plain"])
    assert ref.returncode == 0, ref.stderr[-3000:]
    got = torch.load(tmp_path / "dk" / "rank-0.pt", weights_only=False)
    want = torch.load(tmp_path / "plain" / "rank-0.pt", weights_only=False)
    assert got["world_size"] == 1
    for name in phases.split(","):
        assert got["phases"][name]["error"] is None
        assert _diff(got["phases"][name], want["phases"][name]) == 0.0, name


def render_table() -> str:
    """The markdown table of :data:`EXPECTED` (what docs/api.md shows)."""
    head = "| idiom | " + " | ".join({"zero2": "deepspeed ZeRO-2", "zero3": "deepspeed ZeRO-3"}.get(e, e)
                                      for e in ENGINES) + " |"
    rows = [head, "|" + "---|" * (len(ENGINES) + 1)]
    for idiom, cells in EXPECTED.items():
        shown = ["DDP's result" if c == SAME else "torch's error" if c == "(torch)"
                 else f"error: \"...{c}...\""
                 for c in (expected(idiom, e) for e in ENGINES)]
        rows.append(f"| {idiom} | " + " | ".join(shown) + " |")
    return "\n".join(rows) + "\n"


def test_api_md_shows_the_table_this_suite_proves() -> None:
    doc = (ROOT / "docs" / "api.md").read_text()
    table = render_table()
    assert table in doc, "docs/api.md's idiom table differs from tests/test_conformance.py's EXPECTED; paste:\n" + table
    assert len(re.findall(r"^\| idiom \|", doc, flags=re.M)) == 1


ARGV_STRIPPING = '''
import argparse, json, os, sys
import torch, distkit
parser = argparse.ArgumentParser()
distkit.add_arguments(parser)
args, rest = parser.parse_known_args()
sys.argv = [sys.argv[0]] + rest      # nanoGPT's configurator reads sys.argv itself: distkit's flags removed
dk = distkit.init(args, progress_bar=False)
model, opt = dk.setup(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
print(f"rank {dk.rank}: engine {dk.backend}", flush=True)
'''

ENGINE_BY_ENV = '''
import os, torch, distkit
# the launching process and its ranks resolve different engines (the script reads its own environment)
launched = any(k in os.environ for k in ("DISTKIT_SPAWN_ID", "OMPI_COMM_WORLD_RANK"))
dk = distkit.init({"distributed": {"backend": "ddp" if launched else "mpi"}, "nprocs": 2, "progress_bar": False})
print("trained on", dk.backend, flush=True)
'''


def test_script_that_strips_distkit_flags_from_argv_runs_the_engine_it_asked_for(tmp_path: Path) -> None:
    """nanoGPT-style argv handling: the ``--nprocs`` relaunch uses the original command line, so the ranks
    run the mpi engine the flags ask for (they ran ddp under mpirun before)."""
    script = tmp_path / "strip.py"
    script.write_text(ARGV_STRIPPING)
    res = run([PY, str(script), "--nprocs", "2", "++distributed", "{'backend': 'mpi'}", "--batch_size=4"], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(ln for ln in res.stdout.splitlines() if ln.startswith("rank ")) == [
        "rank 0: engine mpi", "rank 1: engine mpi"]


def test_ranks_that_resolve_another_engine_than_their_launcher_stop_with_one_line(tmp_path: Path) -> None:
    script = tmp_path / "by_env.py"
    script.write_text(ENGINE_BY_ENV)
    res = run([PY, str(script)], timeout=120)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-3000:]
    assert "trained on" not in res.stdout
    errors = [ln.lstrip("\x00") for ln in res.stderr.splitlines() if "resolved engine 'ddp'" in ln]
    assert errors and all(ln.startswith("distkit: error") and "chose 'mpi'" in ln for ln in errors), res.stderr[-3000:]
    assert "Traceback" not in res.stderr
