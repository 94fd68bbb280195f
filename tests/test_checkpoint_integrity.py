"""Never lose a run silently (issue 10, items 4 and 5): `latest` always names a complete checkpoint, a
kill at any point of a re-save leaves it loadable, damaged files are found by their sha256 and a resume
falls back or stops with one line (never from step 0 over an earlier run), a full disk or a checkpoint
that does not fit stops with one line and leaves the previous checkpoint and the run's files intact."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import torch

from conftest import ROOT, distkit, final_params, ok
from distkit import checkpoint, portable
from distkit.commands.cli import main
from distkit.errors import ConfigError

ARGS = ["train", str(ROOT / "configs" / "returnn_ddp.py"), "++max_steps", "10", "++checkpoint_every", "5", "++log_every", "5",
        "++progress_bar", "False"]


def train(out: Path, *extra: str, nprocs: int = 2, **env: str) -> subprocess.CompletedProcess[str]:
    return distkit(*ARGS, "--nprocs", str(nprocs), "++output_dir", str(out), *extra, **env)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-rank run of 10 steps: checkpoints step-5 and step-10 (= an uninterrupted 10-step run)."""
    out = tmp_path_factory.mktemp("base") / "run"
    ok(train(out))
    return out


def copy(base: Path, tmp_path: Path, name: str = "run") -> Path:
    dst = tmp_path / name
    shutil.copytree(base, dst)
    return dst


def untouched(out: Path) -> dict[str, tuple[bytes, int]]:
    """The run's own files, byte for byte with their mtimes: compared before and after a refused start."""
    return {p: ((out / p).read_bytes(), (out / p).stat().st_mtime_ns) for p in ("config.resolved.json", "metrics.jsonl")}


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))  # same size: only the sha256 can tell


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_manifest_records_size_and_sha256(base: Path) -> None:
    ckpt = base / "checkpoints" / "step-0000010"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == 10
    for name in ("rank-00000.pt", "rank-00001.pt"):
        assert manifest["files"][name] == {"size": (ckpt / name).stat().st_size,
                                           "sha256": checkpoint.sha256_file(str(ckpt / name))}
    assert manifest["shapes"]["0.weight"] == [128, 64]
    assert checkpoint.verify(str(ckpt)) is None


@pytest.mark.parametrize("point", ["checkpoint", "manifest", "swap"])
def test_kill_at_any_point_of_a_resave_leaves_latest_loadable(base: Path, tmp_path: Path, point: str) -> None:
    # Resuming the finished run re-saves step 10 at its end (no step left to train); rank 0 is killed
    # inside that save: after its own file, after the manifest, or between moving the old step-0000010
    # aside and putting the new one in place (the window where `latest` named a directory without a manifest).
    out = copy(base, tmp_path)
    killed = train(out, "++resume", "auto", DISTKIT_FAULT=f"0:10:kill:{point}")
    assert killed.returncode != 0 and "rank 0 failed (killed by SIGKILL)" in killed.stderr
    root = out / "checkpoints"
    assert (root / "latest").read_text() == "step-0000010"
    if point == "swap":
        assert not (root / "step-0000010").exists() and (root / ".step-0000010.old" / "manifest.json").exists()
    path, notes = checkpoint.find_resumable(str(root))
    assert path is not None and checkpoint.verify(path) is None and notes == []
    want = final_params(base)
    assert same(portable.model_state(portable.read(path)), want)
    if point != "swap":
        return
    # and a real resume continues from it; the save at its end puts step-0000010 back and removes the aside copy
    resumed = ok(train(out, "++resume", "auto"))
    assert "at step 10" in resumed.stdout
    assert same(final_params(out), want) and same(final_params(out, 1), final_params(base, 1))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-0000005", "step-0000010"]


def test_damaged_latest_falls_back_to_newest_complete(base: Path, tmp_path: Path) -> None:
    out = copy(base, tmp_path)
    root = out / "checkpoints"
    flip_byte(root / "step-0000010" / "rank-00001.pt")
    # leftovers of interrupted saves are removed by the next save
    (root / ".step-0000007.tmp").mkdir()
    (root / ".step-0000007.tmp" / "rank-00000.pt.part").write_bytes(b"x")
    (root / "latest.tmp").write_text("step-0000007")
    resumed = ok(train(out, "++resume", "auto"))
    damaged = root / "step-0000010" / "rank-00001.pt"
    assert (f"distkit: checkpoints/latest names step-0000010, which is unusable: {damaged} does not match its "
            "sha256 in the manifest; resuming from step-0000005, the newest complete checkpoint") in resumed.stdout
    assert "at step 5" in resumed.stdout
    # steps 5..10 retrained: bit-identical to the uninterrupted run, on both ranks
    assert same(final_params(out), final_params(base)) and same(final_params(out, 1), final_params(base, 1))
    assert checkpoint.verify(str(root / "step-0000010")) is None
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-0000005", "step-0000010"]


def test_latest_missing_falls_back_and_nothing_complete_stops(base: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = copy(base, tmp_path)
    root = out / "checkpoints"
    (root / "latest").unlink()
    path, notes = checkpoint.find_resumable(str(root))
    assert path == str(root / "step-0000010")
    assert notes == ["checkpoints/latest is missing; resuming from step-0000010, the newest complete checkpoint"]
    # every checkpoint damaged: ++resume auto stops (one line naming the damaged file), never starts from step 0
    (root / "latest").write_text("step-0000010")
    flip_byte(root / "step-0000010" / "rank-00000.pt")
    (root / "step-0000005" / "manifest.json").unlink()
    before = untouched(out)
    assert main([*ARGS, "--nprocs", "2", "++output_dir", str(out), "++resume", "auto"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0] == (
        f"distkit: error: no complete checkpoint in {root} to resume from: {root / 'step-0000010' / 'rank-00000.pt'} "
        "does not match its sha256 in the manifest; restore the file, resume from a checkpoint directory with "
        "++resume DIR, or start over with ++resume none")
    assert untouched(out) == before
    # only an explicit ++resume none starts over; keep_checkpoints = 1 keeps the newest only
    fresh = ok(train(out, "++resume", "none", "++keep_checkpoints", "1"))
    assert "resumed" not in fresh.stdout
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-0000010"]
    assert same(final_params(out), final_params(base)) and checkpoint.verify(str(root / "step-0000010")) is None


def test_unset_resume_over_existing_checkpoints_is_one_line(base: Path, tmp_path: Path) -> None:
    """Without `resume` a run never replaces an earlier run's checkpoints: one line, exit 2, nothing written."""
    out = copy(base, tmp_path)
    before = untouched(out)
    listing = sorted(p.name for p in (out / "checkpoints").iterdir())
    res = train(out)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == (
        f"distkit: error: output_dir '{out}' holds checkpoints of an earlier run (newest: step-0000010): continue it "
        "with ++resume auto, start over with ++resume none (its checkpoints are then replaced), or choose another "
        "output_dir")
    assert untouched(out) == before and sorted(p.name for p in (out / "checkpoints").iterdir()) == listing


def test_resume_of_a_pre_portable_checkpoint_on_more_ranks_is_one_line(base: Path, tmp_path: Path) -> None:
    """Checkpoints without the portable part (distkit < 0.3) resume only on their own number of ranks."""
    out = copy(base, tmp_path)
    ckpt = out / "checkpoints" / "step-0000010"
    shutil.rmtree(ckpt / "portable")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("portable")}
    manifest["portable"] = False
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    before = untouched(out)
    res = train(out, "++resume", "auto", nprocs=3)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == (
        f"distkit: error: checkpoint '{ckpt}' was written by 2 ranks, this run has 3: resume with 2 ranks (it predates "
        f"portable checkpoints, which resume on any number of ranks), or take its weights to a fresh run with `distkit "
        f"export {ckpt} model.pt`")
    assert untouched(out) == before


OTHER_MODEL = """\
import torch
def model():
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))
"""


def test_checkpoint_of_another_model_is_one_line(base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = copy(base, tmp_path)
    cfg = tmp_path / "other_model.py"
    cfg.write_text(OTHER_MODEL)
    before = untouched(out)
    assert main(["train", str(ROOT / "configs" / "returnn_ddp.py"), str(cfg), "--nprocs", "2", "++output_dir", str(out),
                 "++resume", "auto"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0] == (
        f"distkit: error: checkpoint '{out / 'checkpoints' / 'step-0000010'}' does not fit the model: parameter "
        "'0.weight' has shape [128, 64] in the checkpoint and [32, 64] in the model; resume with the model that "
        "wrote it, or start over with ++resume none")
    assert untouched(out) == before


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


ZERO2 = '{"backend": "deepspeed", "deepspeed_config": {"zero_optimization": {"stage": 2}}}'
DISK_CASES = [  # (engine, its config, tmpfs size: config, metrics and step-5 fit, step-10's files do not)
    # step-5 about 128 KiB in 4 KiB pages: two 15 KB rank files, two 40 KB portable shares
    ("ddp", [], "200k"),
    # step-5 314 KiB (DeepSpeed's model and ZeRO optimizer files besides distkit's). A rank whose write failed
    # inside DeepSpeed's save_checkpoint skipped the barrier at its end: every rank waited for timeout_s, then
    # tracebacks, exit 1, .step-0000010.tmp left behind (here timeout_s 30, not the default 300)
    ("zero2", ["++distributed", ZERO2, "++distributed.timeout_s", "30"], "520k"),
    # smaller: the disk fills inside DeepSpeed's own files (the line names one of them). In one whole-suite run the
    # 520k case still hung until timeout_s with the first fix, which deferred only OSError: which rank fills the disk
    # in which write varies under load, and torch.save can fail with a RuntimeError ("file write failed") instead
    ("zero2-inside-deepspeed", ["++distributed", ZERO2, "++distributed.timeout_s", "30"], "440k"),
]


@pytest.mark.parametrize("engine,extra,size", DISK_CASES, ids=[c[0] for c in DISK_CASES])
def test_disk_full_while_saving_keeps_previous_checkpoint(tmp_path: Path, engine: str, extra: list[str],
                                                          size: str) -> None:
    with tmpfs(tmp_path / "small", f"size={size}") as disk:
        out = disk / "run"
        res = train(out, *extra)
        root = out / "checkpoints"
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr
        line = (f"no space left on device writing '{root / 'step-0000010'}/"), \
            ("; the previous checkpoint step-0000005 is intact (partial files removed): free space or lower "
             "keep_checkpoints, then continue with ++resume auto")
        # one line for the whole job: every rank agreed on the error, rank 0 reports it, the spawner adds nothing
        # (DeepSpeed's run also prints its warnings and distkit's note on the engine the command line chose)
        errors = [ln for ln in res.stderr.strip().splitlines() if engine == "ddp" or ln.startswith("distkit: error")
                  or "Traceback" in ln or "failed" in ln]
        assert len(errors) == 1 and errors[0].startswith(f"distkit: error: {line[0]}") and errors[0].endswith(line[1]), \
            res.stderr
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step-0000005"]  # partial files removed
        assert (root / "latest").read_text() == "step-0000005" and checkpoint.verify(str(root / "step-0000005")) is None
        assert json.loads((out / "config.resolved.json").read_text())["world_size"] == 2
        assert [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()] == [5, 10]
        assert not (out / "summary.json").exists()


def test_leftover_cleanup_and_retention_unit(tmp_path: Path) -> None:
    """mark_latest: leftovers of interrupted saves and checkpoints of an abandoned (later-step) timeline go,
    the newest ``keep`` stay."""
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8, 30):
        (root / f"step-{step:07d}").mkdir(parents=True)
    for junk in (".step-0000010.tmp", ".step-0000006.old", ".step-0000003.old"):
        (root / junk).mkdir()
    (root / ".step-0000003.old" / "manifest.json").write_text("{}")  # an interrupted re-save's only copy of step 3
    (root / "latest.tmp").write_text("x")
    checkpoint.mark_latest(str(root), "step-0000008", keep=3)
    # .step-0000006.old is garbage (step-0000006 exists), .step-0000003.old is moved back, then the newest 3 stay
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-0000004", "step-0000006", "step-0000008"]
    assert (root / "latest").read_text() == "step-0000008"
    checkpoint.check_output_dir(str(tmp_path / "new" / "run"))
    assert not (tmp_path / "new").exists() and not list(tmp_path.glob(".distkit-write-probe-*"))


def test_inspect_reports_progress_engine_model_files_and_integrity(base: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from distkit.tasks.digits import make_model

    assert main(["inspect", str(base), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    model = make_model()
    assert (info["step"], info["samples"], info["world_size"]) == (10, 10 * 2 * 16, 2)
    assert (info["engine"], info["reduce_type"], info["zero_stage"]) == ("ddp", "grad", None)
    assert info["tensors"] == len(model.state_dict())
    assert info["elements"] == sum(t.numel() for t in model.state_dict().values())
    assert info["fp32_bytes"] == 4 * info["elements"] and info["intact"] is True
    ckpt = Path(info["checkpoint"])
    assert ckpt.name == "step-0000010" and info["files"] == {
        str(p.relative_to(ckpt)): p.stat().st_size for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert {"rank-00000.pt", "rank-00001.pt", "portable/.metadata"} <= set(info["files"])
    assert info["portable"] is True and info["global_batch"] == 2 * 16
    assert main(["inspect", str(base)]) == 0
    assert "integrity    intact" in capsys.readouterr().out
    damaged = copy(base, tmp_path)
    flip_byte(damaged / "checkpoints" / "step-0000010" / "rank-00001.pt")
    assert main(["inspect", str(damaged / "checkpoints" / "step-0000010")]) == 1
    assert "DAMAGED" in (out := capsys.readouterr().out) and "rank-00001.pt does not match its sha256" in out
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    assert "is neither a complete distkit checkpoint" in capsys.readouterr().err


def test_latest_of_non_utf8_bytes_is_a_damaged_pointer(base: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 23 item 5a: `latest` holding bytes that are not text is damage like any other, for inspect and resume."""
    out = copy(base, tmp_path)
    root = out / "checkpoints"
    (root / "latest").write_bytes(b"\xff\xfe\x00step")
    why = "checkpoints/latest is damaged (it holds bytes that are not UTF-8 text, not a checkpoint name)"
    assert main(["inspect", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"distkit: {why}; inspecting step-0000010, the newest complete checkpoint"]
    assert f"checkpoint   {root / 'step-0000010'}\n" in captured.out and "integrity    intact" in captured.out
    resumed = ok(train(out, "++resume", "auto"))
    assert f"distkit: {why}; resuming from step-0000010, the newest complete checkpoint\n" in resumed.stdout
    assert "at step 10" in resumed.stdout and "Traceback" not in resumed.stderr
    assert (root / "latest").read_text() == "step-0000010"  # the save at its end wrote a good pointer
    assert same(final_params(out), final_params(base))
    # the run continued from its own checkpoint: its run id is kept, and nothing says otherwise
    assert "written by another run" not in resumed.stdout
    assert json.loads((out / "summary.json").read_text())["run_id"] == json.loads((base / "summary.json").read_text())["run_id"]


def test_inspect_with_latest_missing_inspects_the_newest_complete(base: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 23 item 5c: inspect finds what `++resume auto` would use, and says that `latest` is missing."""
    out = copy(base, tmp_path)
    root = out / "checkpoints"
    (root / "latest").unlink()
    for where in (out, root):
        assert main(["inspect", str(where), "--json"]) == 0
        captured = capsys.readouterr()
        info = json.loads(captured.out)
        assert (info["checkpoint"], info["step"], info["intact"]) == (str(root / "step-0000010"), 10, True)
        assert captured.err.splitlines() == [
            "distkit: checkpoints/latest is missing; inspecting step-0000010, the newest complete checkpoint"]
    assert not (root / "latest").exists()  # inspect writes nothing


def test_run_ids_are_recorded_and_a_checkpoint_of_another_run_is_named(base: Path, tmp_path: Path) -> None:
    """Issue 23 item 5: a checkpoint records the run that wrote it; resuming from another run's checkpoint of
    the same shape (copied into `checkpoints/`) says so in one line, naming both run ids (it was resumed
    without a word)."""
    mine = json.loads((base / "summary.json").read_text())["run_id"]
    assert len(mine) == 12 and int(mine, 16) >= 0
    assert json.loads((base / "config.resolved.json").read_text())["run_id"] == mine
    for step in ("step-0000005", "step-0000010"):
        assert json.loads((base / "checkpoints" / step / "manifest.json").read_text())["run_id"] == mine
    other = tmp_path / "other"
    ok(train(other, "++seed", "7"))
    theirs = json.loads((other / "summary.json").read_text())["run_id"]
    assert theirs != mine
    out = copy(base, tmp_path)
    shutil.rmtree(out / "checkpoints" / "step-0000010")
    shutil.copytree(other / "checkpoints" / "step-0000010", out / "checkpoints" / "step-0000010")
    res = ok(train(out, "++resume", "auto", "++max_steps", "12"))
    notes = [ln for ln in res.stdout.splitlines() if "written by another run" in ln]
    assert notes == [f"distkit: step-0000010 was written by another run (run id {theirs}; this output_dir's run is "
                     f"{mine}): continuing from it; if it was copied here by mistake, stop and remove it, or resume "
                     "from the intended checkpoint with ++resume PATH"], res.stdout
    assert json.loads((out / "summary.json").read_text())["run_id"] == mine


def test_export_and_convert_with_latest_damaged_use_the_newest_complete(base: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 23 item 5: `distkit export` and `distkit convert` find what `++resume auto` would use when
    `latest` is damaged, and say so in one line (they stopped with "is neither a complete checkpoint")."""
    out = copy(base, tmp_path)
    root = out / "checkpoints"
    (root / "latest").write_text("step-9999999")
    why = "distkit: checkpoints/latest names step-9999999, which is unusable"
    assert main(["export", str(out), str(tmp_path / "model.pt")]) == 0
    captured = capsys.readouterr()
    assert len(captured.err.splitlines()) == 1 and why in captured.err, captured.err
    assert "exporting step-0000010, the newest complete checkpoint" in captured.err, captured.err
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert same(exported, final_params(base))
    assert main(["convert", str(out), str(tmp_path / "state.pt")]) == 0
    captured = capsys.readouterr()
    assert len(captured.err.splitlines()) == 1 and why in captured.err
    assert "converting step-0000010, the newest complete checkpoint" in captured.err
    assert f"wrote the portable state of {root / 'step-0000010'}" in captured.out
    assert (root / "latest").read_text() == "step-9999999"  # neither writes into the run


@pytest.mark.parametrize("case", ["checkpoints_a_file", "latest_a_directory"])
def test_checkpoints_a_file_or_latest_a_directory_is_one_line_at_start(base: Path, tmp_path: Path, case: str) -> None:
    """Issue 23 item 5b: found before training (not at the first save), one line, exit 2, nothing written."""
    out = copy(base, tmp_path)
    root = out / "checkpoints"
    before = untouched(out)
    if case == "checkpoints_a_file":
        shutil.rmtree(root)
        root.write_text("not a directory")
        res = train(out, "++resume", "none")
        want = (f"distkit: error: '{root}' is a file, where distkit keeps the run's checkpoint directory: move or "
                "delete it, or choose another output_dir")
    else:
        (root / "latest").unlink()
        (root / "latest").mkdir()
        res = train(out, "++resume", "auto")
        want = (f"distkit: error: '{root / 'latest'}' is a directory, where distkit keeps the file naming the newest "
                "checkpoint: move or delete it (++resume auto then finds the newest complete checkpoint), or choose "
                "another output_dir")
    assert res.returncode == 2 and res.stdout == "" and res.stderr.splitlines() == [want], res.stderr
    assert untouched(out) == before  # metrics.jsonl not started over, config.resolved.json not rewritten


def test_resume_prefers_a_newer_complete_checkpoint_over_a_stale_latest(base: Path, tmp_path: Path) -> None:
    """Issue 23 item 5d: killed after step 10's checkpoint was complete but before `latest` named it, the run
    continues from step 10 (and says why), not from the step 5 that `latest` still names."""
    out = tmp_path / "run"
    killed = train(out, DISTKIT_FAULT="0:10:kill:latest")
    root = out / "checkpoints"
    assert killed.returncode != 0 and "rank 0 failed (killed by SIGKILL)" in killed.stderr
    assert (root / "latest").read_text() == "step-0000005" and checkpoint.verify(str(root / "step-0000010")) is None
    resumed = ok(train(out, "++resume", "auto"))
    assert ("distkit: checkpoints/latest names step-0000005, but step-0000010 is newer and complete; resuming from "
            "step-0000010, the newest complete checkpoint\n") in resumed.stdout
    assert "at step 10" in resumed.stdout and (root / "latest").read_text() == "step-0000010"
    assert same(final_params(out), final_params(base)) and same(final_params(out, 1), final_params(base, 1))


def _config(out: Path) -> "RunConfig":  # type: ignore[name-defined]  # noqa: F821
    from distkit.config import load_config

    return load_config([str(ROOT / "configs" / "returnn_ddp.py")], [("output_dir", str(out)), ("resume", "auto")])


def test_a_stray_newer_checkpoint_of_another_model_gives_way_to_latest(base: Path, tmp_path: Path) -> None:
    """Issue 35 item 10: a complete checkpoint of another model, newer than the one `latest` names, stopped
    ``++resume auto`` (exit 2, "does not fit"); the intact checkpoint `latest` names is used, and the note says
    what was skipped and why. Without a `latest` to fall back on, the first error stands."""
    out = copy(base, tmp_path)
    root = out / "checkpoints"
    stray = root / "step-0000099"
    shutil.copytree(root / "step-0000010", stray)
    manifest = json.loads((stray / "manifest.json").read_text())
    name = next(iter(manifest["shapes"]))
    manifest["shapes"][name] = [3, 3]
    (stray / "manifest.json").write_text(json.dumps(manifest))
    assert checkpoint.verify(str(stray)) is None  # complete: only its model differs
    shapes = checkpoint.read_manifest(str(root / "step-0000010"))["shapes"]
    path, notes = checkpoint.fitting_checkpoint(_config(out), 2, lambda: shapes)
    assert path is not None and Path(path) == root / "step-0000010"
    assert notes == [f"skipped step-0000099, a newer checkpoint than checkpoints/latest that does not fit this run "
                     f"(parameter '{name}' has shape [3, 3] in the checkpoint and {shapes[name]} in the model; resume "
                     "with the model that wrote it, or start over with ++resume none); resuming from step-0000010, "
                     "which latest names"]
    (root / "latest").unlink()
    with pytest.raises(ConfigError, match="step-0000099' does not fit the model"):
        checkpoint.fitting_checkpoint(_config(out), 2, lambda: shapes)


def test_latest_as_a_symlink_to_a_checkpoint_directory_is_what_it_names(base: Path, tmp_path: Path) -> None:
    """Issue 35 item 10: a `latest` that is a symlink to a step directory was refused at start ("is a directory")
    though `distkit inspect` called it intact."""
    out = copy(base, tmp_path)
    root = out / "checkpoints"
    (root / "latest").unlink()
    (root / "latest").symlink_to("step-0000005")
    checkpoint.check_layout(str(out))  # no ConfigError
    assert checkpoint.read_latest(str(root)) == ("step-0000005", None)
    path, notes = checkpoint.fitting_checkpoint(_config(out), 2)
    assert Path(path or "") == root / "step-0000010" and "names step-0000005, but step-0000010 is newer" in notes[0]


@pytest.mark.parametrize("edit", ["world_size", "file_entry", "shapes"])
def test_an_edited_manifest_is_one_line(base: Path, tmp_path: Path, edit: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 35 item 10: a manifest edited by hand (a value of the wrong type) gave a traceback where the value was
    used; it is a damaged checkpoint, named in one line, and a resume falls back to the other checkpoint."""
    out = copy(base, tmp_path)
    step = out / "checkpoints" / "step-0000010"
    manifest = json.loads((step / "manifest.json").read_text())
    if edit == "world_size":
        manifest["world_size"] = "two"
    elif edit == "file_entry":
        manifest["files"][next(iter(manifest["files"]))] = "abc"
    else:
        manifest["shapes"] = {"w": "3x3"}
    (step / "manifest.json").write_text(json.dumps(manifest))
    problem = checkpoint.verify(str(step))
    assert problem is not None and "\n" not in problem and f"'{step}' is damaged: {step / 'manifest.json'} has" in problem
    path, notes = checkpoint.find_resumable(str(out / "checkpoints"))
    assert Path(path or "") == out / "checkpoints" / "step-0000005" and "which is unusable" in notes[0]
    (out / "checkpoints" / "step-0000005").rename(out / "checkpoints" / "gone")
    assert main(["inspect", str(step)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is damaged" in err[0], err


def test_a_refused_run_leaves_no_lock_file_in_an_output_dir_that_had_none(base: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 35 item 10: bad input writes nothing, but a refused run left `.distkit.lock` in an existing
    output_dir (here: checkpoints of an earlier run and no ``resume``)."""
    out = copy(base, tmp_path)
    (out / checkpoint.LOCK_NAME).unlink()
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert main([*ARGS, "--nprocs", "2", "++output_dir", str(out)]) == 2
    assert "holds checkpoints of an earlier run" in capsys.readouterr().err
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before


def test_checkpoint_exists_is_the_one_call_for_a_complete_checkpoint(base: Path, tmp_path: Path) -> None:
    """Issue 36 item 8: a checkpoint is a directory, so a kept ``os.path.isfile(args.resume)`` said "no checkpoint"
    and the script started over. ``distkit.checkpoint.exists`` says whether a complete checkpoint is there; dk.load
    of a path without one is one line, never a fresh start."""
    out = copy(base, tmp_path)
    step = out / "checkpoints" / "step-0000010"
    assert not os.path.isfile(step)  # the habit that misled
    assert checkpoint.exists(str(step)) and checkpoint.exists(str(out / "checkpoints" / "step-0000005"))
    for nothing in (out, out / "checkpoints", tmp_path / "missing", step / "manifest.json"):
        assert not checkpoint.exists(str(nothing)), nothing
    flip_byte(step / "rank-00000.pt")
    assert checkpoint.exists(str(step))  # same size: complete (dk.load's sha256 check names the damage)
    with open(step / "rank-00001.pt", "ab") as f:
        f.write(b"x")
    assert not checkpoint.exists(str(step))
    (out / "checkpoints" / "step-0000005" / "rank-00000.pt").unlink()
    assert not checkpoint.exists(str(out / "checkpoints" / "step-0000005"))
