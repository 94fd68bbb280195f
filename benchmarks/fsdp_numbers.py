"""The fsdp engine's numbers (issue 38 item 8): per-rank memory and step time against ddp and ZeRO-3, through distkit.

    python benchmarks/fsdp_numbers.py [--ranks 2 4] [--engines ddp fsdp zero3] [--size large] [--steps 20]

For each (world size N, engine) it launches ``torchrun --standalone`` with this file as the worker: charlm
``--size`` (large: 10,751,335 parameters), ``torch.optim.Adam``, fp32, micro batch 2 per rank, the engine picked
through ``distkit.init({"distributed": ...})`` exactly as a user's own loop picks it. Each rank counts the bytes of
the distinct storages it holds (the counting of ``zero_memory.py``):

* params: the module's parameter tensors as the rank holds them (fsdp: the DTensor's local shard; ZeRO-3: the
  ``ds_tensor`` partition),
* grads: right after ``dk.backward`` (fsdp: the local shard of the reduce-scattered gradient; ZeRO-3: its
  partitions),
* optimizer: the optimizer's state tensors after ``dk.step`` (fsdp: local shards of Adam's moments), plus
  DeepSpeed's separate fp32 master partition.

Goal (issue 38): fsdp's total per rank <= 0.55 of ddp's at N = 2 and <= 0.30 at N = 4. Expected: 16 Psi / N bytes
(params 4, grads 4, Adam 8), against ddp's 16 Psi and ZeRO-3's 20 Psi / N (its fp32 master copy on CPU).

Step time: after one warm-up step, ``--steps`` steps timed on every rank (barrier, then the loop, then a barrier);
the median of the ranks' per-step seconds is reported as a ratio to ddp's in the same run. On CPU with gloo, a
reduce-scatter and an all-gather are each one all-reduce's worth of traffic per rank (gloo has no native
reduce-scatter), so fsdp moves about 3x ddp's bytes per step (the all-gather before forward, again before
backward, the reduce-scatter): a ratio above 1 here says what gloo costs, not what NCCL would. Timing means
something only on a quiet machine; the memory columns do not depend on load.

Writes ``benchmarks/results/fsdp_numbers.json`` and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from zero_memory import _storages, failure_report  # noqa: E402  (the same counting and failure report)

ENGINES: dict[str, dict[str, Any]] = {
    "ddp": {"backend": "ddp"},
    "fsdp": {"backend": "fsdp"},
    "zero3": {"backend": "deepspeed", "deepspeed_config": {"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}}},
}


def _local(t: Any) -> Any:
    """A DTensor's local shard, a ZeRO-3 parameter's partition, else the tensor itself."""
    if t is None:
        return None
    if hasattr(t, "to_local"):
        return t.to_local()
    return getattr(t, "ds_tensor", t)


def worker(engine: str, size: str, steps: int, out: str) -> None:
    import torch
    import torch.nn.functional as F

    import distkit
    from distkit.tasks.charlm import SIZES, CharTransformer, datasets

    dk = distkit.init({"distributed": ENGINES[engine], "progress_bar": False})
    rank, world = dk.rank, dk.world_size
    train, _, vocab = datasets(64)
    model = CharTransformer(vocab, 64, *SIZES[size])
    psi = sum(p.numel() for p in model.parameters())
    model, optimizer = dk.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    bare = dk.unwrap(model)
    x, y = train.tensors[0][rank * 2:rank * 2 + 2], train.tensors[1][rank * 2:rank * 2 + 2]

    def one_step() -> None:
        logits = model(x)
        dk.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
        dk.step()

    param_st = _storages([_local(p) for p in bare.parameters()])
    logits = model(x)
    dk.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    ds_opt = getattr(getattr(dk._strategy, "engine", None), "optimizer", None)  # ZeRO-3's optimizer wrapper
    grads = [_local(p.grad) for p in bare.parameters()]
    if ds_opt is not None:
        grads += [getattr(ds_opt, "grad_partitions_flat_buffer", None)]
    grad_st = {k: v for k, v in _storages(grads).items() if k not in param_st}
    dk.step()
    base = getattr(ds_opt, "optimizer", None) or optimizer
    state = [_local(t) for s in base.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    masters = list(getattr(ds_opt, "fp32_partitioned_groups_flat", []) or []) if ds_opt is not None else []
    moments_st = {k: v for k, v in _storages(state).items() if k not in param_st}
    master_st = {k: v for k, v in _storages(masters).items() if k not in param_st and k not in moments_st}
    one_step()  # warm-up: every buffer allocated, every group connected
    dk.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step()
    dk.barrier()
    per_step = (time.perf_counter() - t0) / steps if steps else None
    rec = {"rank": rank, "world_size": world, "engine": engine, "psi": psi, "params_bytes": sum(param_st.values()),
           "grads_bytes": sum(grad_st.values()), "optimizer_bytes": sum(moments_st.values()) + sum(master_st.values()),
           "optimizer_fp32_master_bytes": sum(master_st.values()), "step_s": per_step,
           "backend_impl": dk.summary()["backend_impl"]}
    recs = dk.all_gather_object(rec)
    if dk.is_main:
        with open(out, "w") as f:
            json.dump(recs, f)
    dk.close()


def run_case(n: int, engine: str, size: str, steps: int, env: dict[str, str]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        part, log_dir = os.path.join(tmp, "r.json"), os.path.join(tmp, "logs")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
               "--log-dir", log_dir, "--redirects", "2", os.path.abspath(__file__), "--worker", engine,
               "--size", size, "--steps", str(steps), "--out", part]
        # no retry: a run that crashes is a result to look at, not one to hide behind a second try
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(failure_report(n, 0, proc.returncode, proc.stderr, log_dir).replace(
                "zero_memory: case", f"fsdp_numbers: case {engine}").replace(" stage 0", ""))
        with open(part) as f:
            return json.load(f)  # type: ignore[no-any-return]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rank 0's bytes (every rank holds the same up to padding; all ranks in the JSON); the ratio to ddp's total at
    the same N; the median rank's step time and its ratio to ddp's."""
    mib = 1 / 2 ** 20
    out = ["| N | engine | params MiB | grads MiB | optimizer MiB (fp32 master) | total MiB | total / ddp | "
           "expected / ddp | step ms | step / ddp |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["per_rank"][0]
        ddp = next(x for x in rows if x["world_size"] == r["world_size"] and x["engine"] == "ddp")
        tot = m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"]
        d = ddp["per_rank"][0]
        dtot = d["params_bytes"] + d["grads_bytes"] + d["optimizer_bytes"]
        exp = {"ddp": 1.0, "fsdp": 1 / r["world_size"], "zero3": 20 / 16 / r["world_size"]}[r["engine"]]
        step, dstep = r["median_step_s"], ddp["median_step_s"]
        out.append(f"| {r['world_size']} | {r['engine']} | {m['params_bytes'] * mib:.1f} | {m['grads_bytes'] * mib:.1f} | "
                   f"{m['optimizer_bytes'] * mib:.1f} ({m['optimizer_fp32_master_bytes'] * mib:.1f}) | {tot * mib:.1f} | "
                   f"{tot / dtot:.3f} | {exp:.3f} | "
                   + (f"{step * 1e3:.0f} | {step / dstep:.2f} |" if step and dstep else "- | - |"))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--size", default="large")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per case (0: memory only)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "fsdp_numbers.json"))
    args = ap.parse_args()
    if args.worker is not None:
        return worker(args.worker, args.size, args.steps, args.out)
    if "ddp" not in args.engines:
        raise SystemExit("fsdp_numbers: --engines must include ddp (every figure is a ratio to it)")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    rows = []
    for n in args.ranks:
        for engine in args.engines:
            print(f"fsdp_numbers: N={n} {engine} ...", file=sys.stderr, flush=True)
            recs = run_case(n, engine, args.size, args.steps, env)
            steps = sorted(r["step_s"] for r in recs if r["step_s"] is not None)
            rows.append({"world_size": n, "engine": engine, "psi": recs[0]["psi"], "per_rank": recs,
                         "median_step_s": steps[len(steps) // 2] if steps else None})
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"size": args.size, "optimizer": "torch.optim.Adam, fp32", "steps": args.steps, "rows": rows}, f,
                  indent=2)
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
