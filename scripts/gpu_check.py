"""The checks that need a GPU, in one run of under 10 minutes on one GPU, printed as one table (issue 38).

    scripts/gpu_check.sh                  # on a machine with CUDA: every check on cuda, NCCL where it can
    scripts/gpu_check.sh --device cpu     # the same checks on the CPU (gloo): proves the script, not the GPU

Each check is a real ``distkit train`` run (``configs/returnn_ddp.py``'s task, a few steps) compared with another
run, number for number; each runs with a time limit, so one that hangs costs its limit, not the whole budget. The
ranks are as many as there are GPUs (NCCL cannot put two ranks on one GPU): on one GPU the multi-rank comparisons
run on one rank, which still runs every engine's CUDA path.

| check | compares |
|---|---|
| ddp grad, ddp param | the device run with the CPU run of the same job (within 1e-3: other kernels) |
| bf16-mixed, 16-mixed | a run with a checkpoint at step 5 resumed from it against the uninterrupted run (exact) |
| ZeRO-1/2/3 | one DeepSpeed run each (its op builds bounded by the check's limit) against ddp's |
| param overlap | param mode with the int8 exchange overlapped 2 steps (CUDA streams) against ddp param |
| fsdp | the fsdp engine against ddp, grad mode |

No network is needed. Exit status: 0 when every check passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "returnn_ddp.py")


def train(out: Path, nprocs: int, device: str, limit_s: float, *extra: str) -> dict[str, Any]:
    """One ``distkit train`` run; its summary.json (RuntimeError with the output's tail when it failed)."""
    cmd = [sys.executable, "-m", "distkit", "train", CONFIG, "--nprocs", str(nprocs), "++device", device,
           "++max_steps", "10", "++log_every", "5", "++progress_bar", "False", "++output_dir", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
    if res.returncode != 0:
        raise RuntimeError(f"exit {res.returncode}: {(res.stdout + res.stderr)[-600:]}")
    return json.loads((out / "summary.json").read_text())  # type: ignore[no-any-return]


def final_model(out: Path) -> dict[str, Any]:
    from distkit import checkpoint, portable

    latest = checkpoint.latest(str(out / "checkpoints"))
    assert latest is not None, f"no checkpoint in {out}"
    return portable.model_state(portable.read(latest))


def max_diff(a: Path, b: Path) -> float:
    ma, mb = final_model(a), final_model(b)
    assert ma.keys() == mb.keys(), "different parameter names"
    return max(float((ma[k].float() - mb[k].float()).abs().max()) for k in ma)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--limit", type=float, default=150.0, help="seconds each run may take (default 150)")
    args = p.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing checked; "
              "--device cpu runs the same checks on the CPU")
        return 1
    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    n = max(1, gpus)
    dev = args.device
    pg = ("++distributed.pg_backend", "nccl" if dev == "cuda" else "gloo")
    work = Path(tempfile.mkdtemp(prefix="distkit-gpu-check-"))
    rows: list[tuple[str, str, str, float]] = []

    def check(name: str, fn: Callable[[], str], tolerance: Optional[float] = None) -> None:
        t0 = time.perf_counter()
        try:
            figure = fn()
            ok = "pass"
        except Exception as e:  # noqa: BLE001 - one failed check is one row; the others still run
            figure, ok = f"{type(e).__name__}: {e}".replace("\n", " ")[:300], "FAIL"
        rows.append((name, ok, figure, time.perf_counter() - t0))
        print(f"{name}: {ok} ({figure})", flush=True)

    def vs(label: str, a: Path, b: Path, bound: float) -> str:
        d = max_diff(a, b)
        if d > bound:
            raise AssertionError(f"{label}: max abs diff {d:.3g} > {bound:g}")
        return f"{label}: max abs diff {d:.2g}"

    def ddp(mode: str) -> str:
        extra = ("++distributed.reduce_type", "param", "++distributed.param_sync_step", "5") if mode == "param" else ()
        train(work / f"ddp-{mode}", n, dev, args.limit, *pg, *extra)
        train(work / f"ddp-{mode}-cpu", n, "cpu", args.limit, *extra)
        return vs(f"{n} rank(s) {dev} vs cpu", work / f"ddp-{mode}", work / f"ddp-{mode}-cpu", 1e-3)

    def precision(p16: str) -> str:
        whole, part = work / f"{p16}-whole", work / f"{p16}-resumed"
        common = ("++precision", p16, "++checkpoint_every", "5", *pg)
        s = train(whole, n, dev, args.limit, *common)
        train(part, n, dev, args.limit, *common, "++max_steps", "5")
        train(part, n, dev, args.limit, *common, "++resume", "auto")
        d = max_diff(whole, part)
        if d != 0.0:
            raise AssertionError(f"resumed run differs from the uninterrupted one by {d:.3g}")
        return f"resume exact; final loss {s['final_train_loss']:.4f}"

    def zero(stage: int) -> str:
        ds = "{'zero_optimization': {'stage': %d}}" % stage
        train(work / f"zero{stage}", n, dev, args.limit,
              "++distributed", "{'backend': 'deepspeed', 'deepspeed_config': %s}" % ds)
        if not (work / "ddp-grad").exists():
            train(work / "ddp-grad", n, dev, args.limit, *pg)
        return vs(f"ZeRO-{stage} vs ddp", work / f"zero{stage}", work / "ddp-grad", 1e-4)

    def overlap() -> str:
        param = "'reduce_type': 'param', 'param_sync_step': 5"
        train(work / "overlap", n, dev, args.limit, *pg, "++distributed",
              "{" + param + ", 'param_sync_compression': 'int8', 'param_sync_overlap': 2}")
        return vs("int8 + overlap 2 vs ddp param (int8 rounding)", work / "overlap", work / "ddp-param", 5e-2)

    def fsdp() -> str:
        train(work / "fsdp", n, dev, args.limit, *pg, "++distributed.backend", "fsdp")
        return vs("fsdp vs ddp", work / "fsdp", work / "ddp-grad", 1e-5)

    for mode in ("grad", "param"):
        check(f"ddp {mode} ({dev}, {n} rank{'s' if n > 1 else ''})", lambda mode=mode: ddp(mode))  # type: ignore[misc]
    for p16 in ("bf16-mixed", "16-mixed") if dev == "cuda" else ("bf16-mixed",):  # (16-mixed: CUDA only)
        check(f"{p16} through a checkpoint", lambda p16=p16: precision(p16))  # type: ignore[misc]
    for stage in (1, 2, 3):
        check(f"deepspeed ZeRO-{stage}", lambda stage=stage: zero(stage))  # type: ignore[misc]
    check("param mode, int8 exchange overlapped", overlap)
    check("fsdp grad", fsdp)
    name = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"
    print(f"\ngpu_check on {name}, torch {torch.__version__}, {n} rank(s); work directory {work}\n")
    print("| check | result | figure | seconds |\n|---|---|---|---:|")
    for row in rows:
        print(f"| {row[0]} | {row[1]} | {row[2]} | {row[3]:.0f} |")
    return 0 if all(r[1] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
