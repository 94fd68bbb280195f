"""Per-rank memory of parameters, gradients and optimizer state under ZeRO stages 0-3.

    python benchmarks/zero_memory.py [--ranks 2 4] [--stages 0 1 2 3] [--size large]

For each (world size, stage) it launches ``torchrun`` with this file as the worker: charlm
``--size`` (large: ~10.7M parameters), DeepSpeed with ``{"optimizer": Adam (torch_adam)}``, fp32,
one forward/backward/step. Each rank counts the bytes of the *distinct storages* it holds:

* params: the module's parameter tensors (ZeRO-3: the ``ds_tensor`` partitions),
* grads: gradient tensors alive right after backward at the accumulation boundary (``p.grad``,
  ZeRO-1/2 ``averaged_gradients`` partitions, ZeRO-3 ``grad_partitions_flat_buffer``); also the peak
  during backward (sampled in a post-accumulate-grad hook on every parameter),
* optimizer: the torch optimizer's state (Adam exp_avg, exp_avg_sq) plus the fp32 master copy when
  it is a separate storage from the parameters (DeepSpeed 0.19.8 on the CPU accelerator keeps one at
  ZeRO-1, 2 and 3 even in fp32; on CUDA, ZeRO-3 in fp32 aliases it to the parameter partition).

Expected: the fp32 analogue of the ZeRO paper's Psi*(2+2+K) with K=12 for mixed-precision Adam,
i.e. 4 bytes params + 4 bytes grads + 8 bytes Adam moments + 4 bytes fp32 master (stages 1-3, where
the optimizer is partitioned and DeepSpeed keeps a master partition), Psi = parameter count,
N = world size:

| stage | params | grads | optimizer |
|---|---|---|---|
| 0 | 4 Psi | 4 Psi | 8 Psi |
| 1 | 4 Psi | 4 Psi | 12 Psi / N |
| 2 | 4 Psi | 4 Psi / N | 12 Psi / N |
| 3 | 4 Psi / N | 4 Psi / N | 12 Psi / N |

What DeepSpeed does differently (see benchmarks/README.md): at ZeRO-1 it keeps only its gradient
partition after the boundary's reduction (the full 4 Psi exists during backward: the "peak"
column); with the default reduce_bucket_size (5e8 elements, more than this model) every full
gradient is alive at the end of backward at ZeRO-2 and 3 as well.

The paper's mixed-precision totals (2+2+12)Psi, (2+2+12/N)Psi, (2+(2+12)/N)Psi, (16/N)Psi are
printed for reference. Writes ``benchmarks/results/zero_memory.json`` and prints a markdown table
(``--table-only`` re-prints it from the JSON).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _storages(tensors: Any) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        if t is None or not hasattr(t, "untyped_storage") or t.numel() == 0:
            continue
        st = t.untyped_storage()
        out[st.data_ptr()] = max(out.get(st.data_ptr(), 0), st.nbytes())
    return out


def _as_list(x: Any) -> list[Any]:
    """ZeRO-1/2 buckets hold a list of buffers, ZeRO-3 buckets one tensor (or None)."""
    return list(x) if isinstance(x, (list, tuple)) else [x]


def worker(stage: int, size: str, out: str) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import datetime

    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from distkit.tasks.charlm import SIZES, CharTransformer, datasets

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    train, _, vocab = datasets(64)
    model = CharTransformer(vocab, 64, *SIZES[size])
    psi = sum(p.numel() for p in model.parameters())
    conf = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2 * world,
            "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    param_st = _storages(params)

    def grad_parts() -> dict[str, dict[int, int]]:
        """Gradient storages by kind, each kind without the storages of the kinds before it."""
        seen = dict(param_st)
        out: dict[str, dict[int, int]] = {}
        for kind, ts in (
                ("p.grad", [p.grad for p in engine.module.parameters()]),
                ("partitions", [t for part in getattr(opt, "averaged_gradients", {}).values() for t in (part or [])]
                 + [g.grad for g in getattr(opt, "single_partition_of_fp32_groups", [])]
                 + [getattr(opt, "grad_partitions_flat_buffer", None)]),
                # DeepSpeed's staging buffer for bucketed reduction (contiguous_gradients): reduce_bucket_size
                # elements (default 5e8), allocated with torch.empty, so mostly never touched (not resident).
                ("reduction_buffers", [t for b in (getattr(opt, "ipg_buckets", None) or {}).values()
                                       for t in _as_list(getattr(b, "buffer", None))])):
            st = {k: v for k, v in _storages(ts).items() if k not in seen}
            seen.update(st)
            out[kind] = st
        return out

    # Peak of the live gradients during backward: sampled after every parameter's gradient is accumulated
    # (hooks registered after DeepSpeed's, so they see the state after DeepSpeed's own hook ran).
    peak = {"bytes": 0}

    def sample(_p: Any) -> None:
        # Bytes of the gradient tensors themselves (ZeRO-2 makes p.grad a view into its reduce_bucket_size
        # staging buffer, whose whole allocation would otherwise count), plus the partitions.
        live = {g.data_ptr(): g.numel() * g.element_size() for g in (p.grad for p in engine.module.parameters())
                if g is not None}
        peak["bytes"] = max(peak["bytes"], sum(live.values()) + sum(grad_parts()["partitions"].values()))

    hooks = [p.register_post_accumulate_grad_hook(sample) for p in engine.module.parameters() if p.requires_grad]
    x, y = train.tensors[0][rank * 2:rank * 2 + 2], train.tensors[1][rank * 2:rank * 2 + 2]
    logits = engine(x)
    engine.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    for h in hooks:
        h.remove()
    parts = grad_parts()
    grad_st = {**parts["p.grad"], **parts["partitions"]}
    engine.step()
    base = getattr(opt, "optimizer", opt)
    state = [t for s in base.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    masters = list(getattr(opt, "single_partition_of_fp32_groups", [])) + list(getattr(opt, "fp32_partitioned_groups_flat", []))
    moments_st = {k: v for k, v in _storages(state).items() if k not in param_st}
    master_st = {k: v for k, v in _storages(masters).items() if k not in param_st and k not in moments_st}
    opt_st = {**moments_st, **master_st}
    rec = {"rank": rank, "world_size": world, "stage": stage, "psi": psi, "params_bytes": sum(param_st.values()),
           "grads_bytes": sum(grad_st.values()), "optimizer_bytes": sum(opt_st.values()),
           "breakdown": {"grads_full_p_grad_bytes": sum(parts["p.grad"].values()),
                         "grads_partition_bytes": sum(parts["partitions"].values()),
                         "grads_peak_during_backward_bytes": peak["bytes"],
                         "grad_reduction_buffer_bytes_allocated": sum(parts["reduction_buffers"].values()),
                         "optimizer_moments_bytes": sum(moments_st.values()),
                         "optimizer_fp32_master_bytes": sum(master_st.values())}}
    recs: list[Any] = [None] * world
    dist.all_gather_object(recs, rec)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(recs, f)
    # Leave together: a rank that tears its gloo connections down while a peer is still inside the last
    # exchange can end that peer with "terminate called ... gloo::IoException" (SIGABRT); distkit's
    # Session.close has the same barrier. The likely cause of the one ZeRO-3 abort seen here (not reproduced).
    dist.barrier()
    dist.destroy_process_group()


def expected(stage: int, psi: int, n: int) -> dict[str, float]:
    fp32 = {0: (4, 4, 8), 1: (4, 4, 12 / n), 2: (4, 4 / n, 12 / n), 3: (4 / n, 4 / n, 12 / n)}[stage]
    mixed = {0: 16, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage]
    return {"params_bytes": fp32[0] * psi, "grads_bytes": fp32[1] * psi, "optimizer_bytes": fp32[2] * psi,
            "paper_mixed_precision_total_bytes": mixed * psi}


#: lines of a failed rank's stderr that a failure report shows
TAIL_LINES = 40


def _tail(path: str, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of text file ``path``."""
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def failure_report(n: int, stage: int, returncode: int, launcher_stderr: str, log_dir: str) -> str:
    """What to print when the torchrun of case (``n`` ranks, ZeRO ``stage``) exited with ``returncode``.

    Each rank's stderr is in its own file (torchrun ``--log-dir``/``--redirects``:
    ``LOG_DIR/<run id>/attempt_0/<local rank>/stderr.log``), so the report shows the failing rank's own
    output, not the ranks' lines interleaved. The failing rank is torchrun's "Root Cause (first observed
    failure)"; the others usually failed only because it did. Where torchrun names none (it failed itself,
    or its summary changed), every rank's stderr and torchrun's own are shown.
    """
    logs = {int(os.path.basename(os.path.dirname(p))): p
            for p in glob.glob(os.path.join(log_dir, "*", "attempt_*", "*", "stderr.log"))}
    root: Optional[re.Match[str]] = re.search(
        r"Root Cause.*?rank\s*:\s*(\d+) \(local_rank: (\d+)\)\s*\n\s*exitcode\s*:\s*([^\n]*)", launcher_stderr, re.S)
    head = f"zero_memory: case N={n} stage {stage} failed (torchrun exit status {returncode})"
    if root is not None and int(root.group(2)) in logs:
        rank, local, exitcode = int(root.group(1)), int(root.group(2)), " ".join(root.group(3).split())
        return (f"{head}: rank {rank} failed first, exit code {exitcode}; its stderr (last {TAIL_LINES} lines):\n"
                f"{_tail(logs[local])}")
    parts = [f"{head}; torchrun named no failing rank. torchrun's stderr (last {TAIL_LINES} lines):\n"
             f"{''.join(launcher_stderr.splitlines(keepends=True)[-TAIL_LINES:])}"]
    parts += [f"local rank {r}'s stderr (last {TAIL_LINES} lines):\n{_tail(p)}" for r, p in sorted(logs.items())]
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--size", default="large")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--table-only", action="store_true", help="re-print the table from --out (expected values recomputed)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "zero_memory.json"))
    args = ap.parse_args()
    if args.worker is not None:
        return worker(args.worker, args.size, args.out)
    if args.table_only:
        with open(args.out) as f:
            saved = json.load(f)
        for r in saved["rows"]:
            r["expected_fp32"] = expected(r["stage"], r["psi"], r["world_size"])
        with open(args.out, "w") as f:
            json.dump(saved, f, indent=2)
        print(markdown_table(saved["rows"]))
        return None
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    rows = []
    for n in args.ranks:
        for stage in args.stages:
            with tempfile.TemporaryDirectory() as tmp:
                part, log_dir = os.path.join(tmp, "r.json"), os.path.join(tmp, "logs")
                # each rank's stderr to its own file (--redirects 2), so a failure report can show the failing
                # rank's own output
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                       "--log-dir", log_dir, "--redirects", "2",
                       os.path.abspath(__file__), "--worker", str(stage), "--size", args.size, "--out", part]
                # no retry: a run that crashes is a result to look at, not one to hide behind a second try
                proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      check=False)
                if proc.returncode != 0:
                    raise SystemExit(failure_report(n, stage, proc.returncode, proc.stderr, log_dir))
                with open(part) as f:
                    recs = json.load(f)
            exp = expected(stage, recs[0]["psi"], n)
            rows.append({"world_size": n, "stage": stage, "psi": recs[0]["psi"], "per_rank": recs, "expected_fp32": exp})
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"size": args.size, "optimizer": "Adam (torch_adam), fp32", "rows": rows}, f, indent=2)
    print(markdown_table(rows))


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rank 0's numbers (every rank holds the same amount up to padding; all ranks are in the JSON)."""
    mib = 1 / 2 ** 20
    out = [("| N | stage | params MiB (exp) | grads MiB after backward (exp) | grads peak in backward | "
            "optimizer MiB (exp) = moments + fp32 master | total MiB (exp) | paper mixed-precision MiB |"),
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, e = r["per_rank"][0], r["expected_fp32"]
        b = m.get("breakdown", {})
        tot = m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"]
        etot = e["params_bytes"] + e["grads_bytes"] + e["optimizer_bytes"]
        out.append(f"| {r['world_size']} | {r['stage']} | {m['params_bytes'] * mib:.1f} ({e['params_bytes'] * mib:.1f}) | "
                   f"{m['grads_bytes'] * mib:.1f} ({e['grads_bytes'] * mib:.1f}) | "
                   f"{b.get('grads_peak_during_backward_bytes', float('nan')) * mib:.1f} | "
                   f"{m['optimizer_bytes'] * mib:.1f} ({e['optimizer_bytes'] * mib:.1f}) = "
                   f"{b.get('optimizer_moments_bytes', float('nan')) * mib:.1f} + "
                   f"{b.get('optimizer_fp32_master_bytes', float('nan')) * mib:.1f} | "
                   f"{tot * mib:.1f} ({etot * mib:.1f}) | {e['paper_mixed_precision_total_bytes'] * mib:.1f} |")
    return "\n".join(out)

if __name__ == "__main__":
    main()
