"""The slow-link study: grad mode vs param mode (H = 10, 100, 500) vs DiLoCo across two hosts joined by a
shaped link.

    python benchmarks/slow_link.py [--rates 25,100,1000,0] [--speed-steps 40] [--quality-steps 1500]
                                   [--corpus pydoc|stdlib] [--engines ddp,mpi] [--outer 0.7:0.9,...]
                                   [--seed 42] [--repeats 1] [--only speed|quality] [--out results/slow_link.json]
                                   [--work runs/slow_link_quality] [--workers 2]

Root is needed (network namespaces; ``tests/hosts.py``). Two parts:

**Speed** (2 hosts x 1 rank, each a network namespace on a private bridge, ``tbf`` on both ends of every
host's link at ``--rates`` Mbit/s, 0 = unshaped): charlm medium (1.83M parameters, 7.3 MB per full
exchange), one ``torchrun`` per host (DDP) or one ``mpirun`` across both (the mpi engine). A run lasts
``max(--speed-steps, H + 10)`` steps. Reported per run: samples/s after the first 10 steps (warm-up;
from distkit's metrics.jsonl, logged every 10 steps: samples between the lines at step 10 and the
last step over the time between them),
so a param-mode run's measured window holds exactly H steps and one sync and runs of different
lengths compare fairly; the bytes each host's ``eth0`` sent
per step (``/sys/class/net/eth0/statistics/tx_bytes`` inside the namespace, before and after the
run, divided by the steps: start-up's model broadcast and the end's checks included), distkit's own
payload count, and ``comm_wait_s``. ``--repeats N`` runs the whole speed sweep N times in rounds (every
rate and mode once per round, so a drift in the machine's speed touches all of them alike); each row
then holds the run with the median samples/s, with every run's samples/s in ``samples_per_s_runs``,
and ``speed_vs_grad_rounds`` / ``speed_vs_unshaped_rounds`` give the median, min and max of the
ratios taken within each round.

**Quality** (unshaped, one host, ``--nprocs 2``: grad and param mode compute the same numbers whatever
the link, so quality is measured at full length without shaping, and speed on the shorter shaped
runs): ``--quality-steps`` steps of each mode with the same seed, data and global batch, eval loss at
the end (equal number of samples), on charlm's ``--corpus`` (``stdlib`` for runs long enough to pass
more than once over ``pydoc``'s 6,540 windows). DiLoCo is swept over ``--outer`` (outer lr : momentum).
``--seed`` other than 42 runs the same as repeats with another seed (kept apart, under ``repeats``),
which show how much eval loss moves from seed to seed. A mode may carry a codec
(``diloco100-int8``, ``-int4``, ``-e3m0``, ``-tk<percent>b<bits>`` for top-k, e.g. ``diloco100-tk1b2``: 1 % of each chunk of
4096, 2-bit values); each quality record holds the bytes one rank sends per sync, from the codec's encoded sizes
(``bytes_per_sync_per_rank``: :func:`link_bytes_per_sync`, the floating buffers in fp32 included), and distkit's
own count of rank 0's collective bytes (``comm_bytes_rank0``). Each run
checkpoints and resumes in ``--work``, and ``--out`` is rewritten after each run: a study cut short
goes on where it stopped when the same command runs again.

**Step-time model**: ``t(mode, R) = t(mode, unshaped) + F * max(0, e * 8 * framing / R - tau * t_unshaped) / H``
with ``e = E / F * b / 4``: the unshaped step time holds compute and latency; ``E`` is one full exchange
(the gradient bytes DDP reduces per step, 7.3 MB), ``H`` the steps per exchange (1 in grad mode), ``F``
the fragments (each exchange moves 1/F of the model), ``b`` the codec's bytes per element (4, 2 or 1),
``tau`` the steps an exchange overlaps (its link time beyond that much compute is waited for), ``framing``
the bytes each host's interface sent per payload byte on the unshaped grad run (TCP/IP headers, ACKs,
start-up's model broadcast amortised). Without fragments, codec and overlap it is ``E / H * 8 * framing / R``. A 2-rank ring all-reduce sends ``E`` bytes each way at once, so the link adds
``E * 8 / R`` seconds per exchange. Each shaped run's step time is compared with the model's (error in %).

Writes ``benchmarks/results/slow_link.json`` and ``benchmarks/results/slow_link.png`` (samples/s and
eval loss against link speed, one line per mode). Needs matplotlib (``pip install -e '.[bench]'``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import hosts as nethosts  # noqa: E402  (tests/hosts.py: the network-namespace harness)
from runenv import child_env  # noqa: E402

BIN = os.path.dirname(sys.executable)
#: steps left out of the speed measurement (start-up, the first steps' allocations); also the logging interval
WARMUP = 10
RESULTS = os.path.join(HERE, "results")
#: a quality run's checkpoint interval in steps (its resume point when killed part-way)
QUALITY_CHECKPOINT_EVERY = 500
#: the study's seed; a quality run with another (``--seed``) is a repeat that measures the spread
SEED = 42
WORKLOAD = ["train", os.path.join(ROOT, "configs", "charlm.json"), "++charlm_size", "medium", "++batch_size", "16",
            "++optimizer", "{'class': 'adam'}", "++learning_rate", "0.003", "++checkpoint_every", "None",
            "++progress_bar", "False", "++resume", "none", "++seed", str(SEED)]


#: bytes per element on the link of each dense ``param_sync_compression`` codec (int8's block scales left out;
#: int4's and e3m0's included: 64 bytes of values and 4 of scale per 128 elements). Top-k: :func:`codec_bytes`
CODEC_BYTES = {"none": 4, "bf16": 2, "fp16": 2, "int8": 1, "int4": 0.53125, "e3m0": 0.53125}
#: a top-k suffix's chunk (distkit's default param_sync_topk_chunk)
TOPK_CHUNK = 4096


def topk_option(o: str) -> Optional[str]:
    """A ``tk<percent>b<bits>`` suffix (e.g. ``tk3b2``: density 0.03, 2-bit values; ``tk3.125b4``) as distkit's
    codec string ``"topk:<density>:<bits>:<chunk>"`` (distkit.sync.compression.codec_of); None otherwise."""
    if not o.startswith("tk") or "b" not in o:
        return None
    pct, _, bits = o[2:].partition("b")
    try:
        density = float(pct) / 100
    except ValueError:
        return None
    if not (0 < density <= 1) or bits not in ("2", "4", "8"):
        return None
    return f"topk:{density!r}:{bits}:{TOPK_CHUNK}"


def codec_bytes(codec: str) -> float:
    """Bytes per element of ``codec``'s encoding (top-k: distkit's ``encoded_size`` of one chunk, indices,
    values and scale; the dense codecs: :data:`CODEC_BYTES`)."""
    if codec.startswith("topk:"):
        from distkit.sync.compression import encoded_size
        return encoded_size(TOPK_CHUNK, codec) / TOPK_CHUNK
    return CODEC_BYTES[codec]


def link_bytes_per_sync(n: int, codec: str, p: int) -> int:
    """Bytes one rank sends per sync of ``n`` averaged fp32 elements among ``p`` ranks: plain fp32 (``"none"``) a
    ring all-reduce's ``2 (p-1)/p * 4n``; a dense codec the two phases' ``2 (p-1)`` encoded chunks of
    ``ceil(n / (p * unit)) * unit`` elements (an all-to-all, then an all-gather of the owner's mean); top-k the
    all-gather of the whole encoding (``n`` padded to whole chunks) to the ``p - 1`` others
    (distkit/sync/compression.py's Exchange)."""
    from distkit.sync.compression import _unit, encoded_size
    if codec == "none":
        return round(2 * (p - 1) / p * 4 * n)
    unit = _unit(codec)
    if codec.startswith("topk:"):
        return (p - 1) * encoded_size(-(-n // unit) * unit, codec)
    chunk = -(-n // (p * unit)) * unit
    return 2 * (p - 1) * encoded_size(chunk, codec)


def mode_options(mode: str) -> tuple[str, int, str, int]:
    """``param<H>`` / ``diloco<H>`` with optional ``-f<F>`` (param_sync_fragments), ``-bf16``/``-fp16``/``-int8``/
    ``-int4``/``-e3m0``/``-tk<percent>b<bits>`` (param_sync_compression; ``tk`` = "topk" at that density and value bits, chunk
    4096) and ``-o<tau>`` (param_sync_overlap) suffixes, e.g. ``diloco100-f4-int8-o5``, ``diloco100-tk1b2``:
    (base, F, codec, tau), codec a top-k codec string for ``tk``; ValueError otherwise."""
    base, *options = mode.split("-")
    fragments, codec, overlap = 1, "none", 0
    for o in options:
        if o in CODEC_BYTES and o != "none" and codec == "none":
            codec = o
        elif topk_option(o) and codec == "none":
            codec = topk_option(o)  # type: ignore[assignment]
        elif o.startswith("f") and o[1:].isdigit() and int(o[1:]) >= 1 and fragments == 1:
            fragments = int(o[1:])
        elif o.startswith("o") and o[1:].isdigit() and int(o[1:]) >= 1 and overlap == 0:
            overlap = int(o[1:])
        else:
            raise ValueError(mode)
    if base == "grad" and options:
        raise ValueError(mode)
    return base, fragments, codec, overlap


def mode_args(mode: str, outer: Optional[tuple[float, float]] = None) -> dict[str, Any]:
    """``grad``, ``param<H>`` or ``diloco<H>`` (with :func:`mode_options`' suffixes) as a ``distributed`` block
    (engine added by the caller)."""
    if mode == "grad":
        return {"reduce_type": "grad"}
    _, fragments, codec, overlap = mode_options(mode)
    d: dict[str, Any] = {"reduce_type": "param", "param_sync_step": sync_period(mode)}
    if mode.startswith("diloco"):
        lr, momentum = outer or (0.7, 0.9)
        d["outer_optimizer"] = {"class": "nesterov", "lr": lr, "momentum": momentum}
    if fragments > 1:
        d["param_sync_fragments"] = fragments
    if codec.startswith("topk:"):
        _, density, bits, chunk = codec.split(":")
        d.update(param_sync_compression="topk", param_sync_topk_density=float(density),
                 param_sync_topk_bits=int(bits), param_sync_topk_chunk=int(chunk))
    elif codec != "none":
        d["param_sync_compression"] = codec
    if overlap:
        d["param_sync_overlap"] = overlap
    return d


def sync_period(mode: str) -> int:
    """Steps per exchange of ``grad`` (1), ``param<H>`` or ``diloco<H>`` (H; with suffixes: H, each fragment's
    period); ValueError for another name."""
    base = mode_options(mode)[0]
    if base == "grad":
        return 1
    for prefix in ("param", "diloco"):
        if base.startswith(prefix) and base[len(prefix):].isdigit() and int(base[len(prefix):]) >= 1:
            return int(base[len(prefix):])
    raise ValueError(mode)


def env() -> dict[str, str]:
    """:func:`runenv.child_env` with the venv's ``bin/`` first on PATH (mpirun starts ranks by name)."""
    return child_env(PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")


def tx_bytes(h: nethosts.Hosts, i: int) -> int:
    """Bytes host ``i``'s eth0 has sent (the namespace's own sysfs)."""
    out = subprocess.run(["ip", "netns", "exec", h.names[i], "cat", "/sys/class/net/eth0/statistics/tx_bytes"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def finish(procs: list["subprocess.Popen[str]"], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"timed out after {timeout:.0f} s: {' '.join(map(str, p.args))}") from None
        if p.returncode != 0:
            raise RuntimeError(f"exit {p.returncode}: {' '.join(map(str, p.args))}\n{out[-2000:]}\n{err[-3000:]}")


def speed_run(h: nethosts.Hosts, engine: str, mode: str, steps: int, out: str, work: str) -> dict[str, Any]:
    """One training run across the two hosts; its summary plus the interface counts."""
    dist = {"backend": engine, **mode_args(mode)}
    args = [*WORKLOAD, "++max_steps", str(steps), "++eval_every", "None", "++log_every", str(WARMUP),
            "++distributed", json.dumps(dist), "++output_dir", out]
    before = [tx_bytes(h, i) for i in range(h.n)]
    if engine == "mpi":
        agent = h.rsh_agent(work)
        cmd = [os.path.join(BIN, "mpirun"), "-np", str(h.n), "--host", ",".join(f"{n}:1" for n in h.names),
               *h.mpirun_args(agent), "-x", "PATH", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
               sys.executable, "-m", "distkit", *args]
        procs = [h.popen(0, cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env())]
    else:
        procs = [h.popen(i, [os.path.join(BIN, "torchrun"), "--nnodes", str(h.n), "--nproc-per-node", "1",
                             "--rdzv-backend", "c10d", "--rdzv-id", "slowlink", "--rdzv-endpoint", f"{h.names[0]}:29400",
                             "-m", "distkit", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env())
                 for i in range(h.n)]
    finish(procs, 60 + steps * 10)
    sent = [tx_bytes(h, i) - b for i, b in zip(range(h.n), before)]
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    # a log line's samples_per_s is the samples so far over the loop's time so far: its time is the ratio
    logged = [(x["samples"], x["samples"] / x["samples_per_s"]) for x in lines if "samples_per_s" in x and x["step"] >= WARMUP]
    (n0, t0), (n1, t1) = logged[0], logged[-1]
    sps = (n1 - n0) / (t1 - t0)
    per_step = s["samples"] / s["steps"]
    return {"samples_per_s": sps, "step_time_s": per_step / sps, "steps": s["steps"],
            "samples_per_s_whole_run": s["samples_per_s"],
            "iface_bytes_per_step": sum(sent) / len(sent) / s["steps"],
            "payload_bytes_per_step": s["comm_bytes"] / s["steps"], "comm_wait_s": s["comm_wait_s"],
            "compute_fraction": s["compute_fraction"], "num_nodes": s["num_nodes"]}


def quality_run(mode: str, steps: int, out: str, outer: Optional[tuple[float, float]] = None,
                corpus: str = "pydoc", seed: int = SEED, workers: int = 2) -> dict[str, Any]:
    """One unshaped ``--nprocs workers`` run of ``steps`` steps on charlm's ``corpus`` in ``out`` (batch 16 per
    rank: the global batch grows with ``workers``); its eval loss at the end.

    ``seed`` sets the model's initial weights and the data order (the same on every rank).
    The run checkpoints every :data:`QUALITY_CHECKPOINT_EVERY` steps and starts with ``++resume auto``, so
    a long run killed part-way (a 15,000-step run takes about 48 min here) goes on from its last
    checkpoint when called again with the same ``out``; resume is bit-identical (tests/test_parity.py).
    """
    dist = {"backend": "ddp", **mode_args(mode, outer)}
    cmd = [sys.executable, "-m", "distkit", *WORKLOAD, "--nprocs", str(workers), "++max_steps", str(steps),
           "++eval_every", str(steps), "++log_every", str(max(1, steps // 10)), "++distributed", json.dumps(dist),
           "++output_dir", out, "++checkpoint_every", str(QUALITY_CHECKPOINT_EVERY), "++keep_checkpoints", "1",
           "++resume", "auto", "++charlm_corpus", corpus, "++seed", str(seed)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env())
    if res.returncode != 0:
        raise RuntimeError(f"exit {res.returncode}: {' '.join(cmd)}\n{res.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    q = {"eval_loss": s["eval_loss"], "steps": s["steps"], "samples": s["samples"],
         "syncs": steps // sync_period(mode), "corpus": corpus, "workers": workers,
         "comm_bytes_rank0": s["comm_bytes"]}  # distkit's count of the bytes rank 0 handed to collectives
    return {**q, **sync_bytes(mode, corpus, workers)}


def averaged_elements(corpus: str) -> tuple[int, int]:
    """(parameters, floating-buffer elements) of charlm medium on ``corpus`` (the vocabulary is the corpus'), at the
    default sequence length: what param mode averages. The buffers (the causal mask) go uncompressed in every codec."""
    from distkit.config.schema import RunConfig
    from distkit.tasks.charlm import SIZES, CharTransformer, datasets
    seq_len = RunConfig.__dataclass_fields__["charlm_seq_len"].default
    vocab = datasets(seq_len, corpus)[2]
    m = CharTransformer(vocab, seq_len, *SIZES["medium"])
    return (sum(t.numel() for t in m.parameters()),
            sum(b.numel() for b in m.buffers() if b.is_floating_point()))


def sync_bytes(mode: str, corpus: str, workers: int) -> dict[str, Any]:
    """Bytes one rank sends per sync (grad mode: per step, DDP's ring all-reduce of the gradients) from the codec's
    sizes (:func:`link_bytes_per_sync`): the parameters' pseudo-gradient encoded, the floating buffers in fp32."""
    n, buffers = averaged_elements(corpus)
    if mode == "grad":
        return {"codec": "none", "params": n, "bytes_per_sync_per_rank": link_bytes_per_sync(n, "none", workers)}
    codec = mode_options(mode)[2]
    params = link_bytes_per_sync(n, codec, workers)
    buf = link_bytes_per_sync(buffers, "none", workers)
    return {"codec": codec, "params": n, "buffer_elements": buffers, "codec_bytes_per_element": codec_bytes(codec),
            "param_bytes_per_sync_per_rank": params, "buffer_bytes_per_sync_per_rank": buf,
            "bytes_per_sync_per_rank": params + buf}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median samples/s (the lower one of the middle two for an even count), with every run's
    samples/s in ``samples_per_s_runs`` in round order: a real run, not an average of fields that belong together."""
    pick = sorted(runs, key=lambda r: r["samples_per_s"])[(len(runs) - 1) // 2]
    return {**pick, "samples_per_s_runs": [r["samples_per_s"] for r in runs]}


def round_ratios(num: list[float], den: list[float]) -> dict[str, Any]:
    """Ratios of two rows' samples/s taken within each round (paired), with their median, min and max."""
    ratios = [a / b for a, b in zip(num, den)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": ratios}


def model(results: dict[str, Any]) -> None:
    """Add each shaped run's predicted samples/s (see the module docstring) and the error."""
    speed = results["speed"]
    for engine, by_mode in speed.items():
        unshaped_grad = by_mode.get("grad", {}).get("0")
        if unshaped_grad is None:  # the model's framing and exchange size come from the unshaped grad run
            continue
        exchange = speed.get("ddp", by_mode)["grad"]["0"]["payload_bytes_per_step"]  # DDP counts gradients only
        framing = unshaped_grad["iface_bytes_per_step"] / exchange
        results.setdefault("framing", {})[engine] = framing
        for mode, by_rate in by_mode.items():
            base = by_rate.get("0")
            if base is None:
                continue
            # per period H: F exchanges of 1/F of the model each, at the codec's size; with overlap tau, each one's
            # link time beyond tau steps of compute (the unshaped step) is what the steps wait for
            _, fragments, codec, tau = mode_options(mode)
            h = sync_period(mode)
            event = exchange / fragments * codec_bytes(codec) / 4  # 2 ranks: every codec sends its encoding once
            for rate, r in by_rate.items():
                if rate == "0":
                    continue
                link = event * 8 * framing / (float(rate) * 1e6)
                t = base["step_time_s"] + fragments * max(0.0, link - tau * base["step_time_s"]) / h
                r["model_step_time_s"] = t
                r["model_error_pct"] = 100 * (r["step_time_s"] - t) / t


def plot(results: dict[str, Any], path: str) -> None:
    """Speed and eval loss against link speed; for a file without speed runs, :func:`plot_quality`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not results["speed"]:
        plot_quality(results, path)
        return
    quality = results.get("quality", {})
    # a speed-only file (a --repeats run of its own) gets no empty quality panel
    fig, axes = plt.subplots(1, 2 if quality else 1, figsize=(11, 4.2) if quality else (6, 4.2), squeeze=False)
    ax1 = axes[0][0]
    rates = sorted({float(r) for e in results["speed"].values() for m in e.values() for r in m if r != "0"})
    unshaped_x = max(rates) * 10 if rates else 10000.0
    repeated = False  # any row from --repeats: the title explains its bars
    for engine, by_mode in results["speed"].items():
        for mode, by_rate in by_mode.items():
            xs = sorted(by_rate, key=lambda r: float(r) or unshaped_x)
            line, = ax1.plot([float(r) or unshaped_x for r in xs], [by_rate[r]["samples_per_s"] for r in xs], marker="o",
                             linestyle="-" if engine == "ddp" else "--", label=f"{mode} ({engine})")
            spread = [r for r in xs if len(by_rate[r].get("samples_per_s_runs", [])) > 1]
            for r in spread:  # --repeats: the line goes through the median run, the bar spans every run
                repeated = True
                runs = by_rate[r]["samples_per_s_runs"]
                ax1.plot([float(r) or unshaped_x] * 2, [min(runs), max(runs)], color=line.get_color(), linewidth=3, alpha=0.4)
            modelled = [r for r in xs if "model_step_time_s" in by_rate[r]]
            ax1.plot([float(r) for r in modelled], [by_rate[r]["samples_per_s"] * by_rate[r]["step_time_s"]
                                                    / by_rate[r]["model_step_time_s"] for r in modelled],
                     marker="x", linestyle="none", color=line.get_color())
    ax1.set_xscale("log")
    ax1.set_xlabel(f"link speed, Mbit/s ({unshaped_x:g} = unshaped)")
    ax1.set_ylabel("samples/s (2 hosts x 1 rank)")
    ax1.set_title("speed (charlm medium); x = step-time model" + ("; bars: min-max of the rounds" if repeated else ""), fontsize=9)
    ax1.legend(fontsize=7)
    if not quality:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return
    ax2 = axes[0][1]
    xs = [*rates, unshaped_x]
    for mode, q in quality.items():
        ax2.plot(xs, [q["eval_loss"]] * len(xs), marker=".", label=f"{mode}: {q['eval_loss']:.3f}")
    ax2.set_xscale("log")
    ax2.set_xlabel("link speed, Mbit/s (the result does not depend on it)")
    ax2.set_ylabel(f"eval loss after {next(iter(quality.values()))['steps'] if quality else '?'} steps")
    ax2.set_title("quality at an equal number of samples")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_quality(results: dict[str, Any], path: str) -> None:
    """A quality-only study: one bar per run (every DiLoCo setting of the sweep too), its eval loss,
    its ratio to grad mode's and its number of syncs."""
    import matplotlib.pyplot as plt

    # a DiLoCo record carries its outer settings; its sync period is steps per sync; its label's mode, the suffixes
    # (fragments, codec, overlap: e.g. "diloco100-tk1b2 lr 1 m 0.1" -> "tk1b2")
    def diloco(k: str, v: dict[str, Any]) -> str:
        suffix = k.split(" ")[0].partition("-")[2]
        return (f"DiLoCo H={v['steps'] // v['syncs']}{' ' + suffix if suffix else ''}\n"
                f"lr {v['outer_lr']:g} m {v['outer_momentum']:g}")
    runs = {m: q for m, q in results["quality"].items() if not m.startswith("diloco")}
    runs.update({diloco(k, v): v for k, v in results.get("diloco_sweep", {}).items()})
    # a repeat with another seed: its own bar, its ratio against grad mode of the same seed
    for k, v in results.get("repeats", {}).items():
        name = diloco(k, v) if "outer_lr" in v else k.split(" seed ")[0]
        runs[f"{name}\nseed {v['seed']}"] = {**v, "ratio": results.get("repeats_vs_grad", {}).get(k)}
    grad = results["quality"].get("grad", {}).get("eval_loss")
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(runs)), 4.2))
    losses = [q["eval_loss"] for q in runs.values()]
    bars = ax.bar(range(len(runs)), losses, color=["tab:blue" if m.startswith("grad") else "tab:orange" if m.startswith("param")
                                                   else "tab:purple" for m in runs])
    for bar, q in zip(bars, runs.values()):
        r = q["ratio"] if "ratio" in q else q["eval_loss"] / grad if grad else None  # a repeat's: same seed's grad
        ratio = f"{r:.4f}x grad\n" if r else ""
        ax.annotate(f"{q['eval_loss']:.4f}\n{ratio}{q['syncs']} syncs", (bar.get_x() + bar.get_width() / 2, q["eval_loss"]),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(runs)), list(runs), fontsize=7)
    if grad:
        ax.axhline(grad, color="tab:blue", linewidth=0.8, linestyle=":")
    low, high = min(losses), max(losses)
    ax.set_ylim(low - 0.5 * (high - low + 0.01), high + 0.6 * (high - low + 0.01))
    first = next(iter(results["quality"].values()))
    ax.set_ylabel(f"eval loss after {first['steps']} steps (lower is better)")
    ax.set_title(f"quality at an equal number of samples ({first['samples']:,}; corpus {first.get('corpus', 'pydoc')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def quality_part(a: argparse.Namespace, modes: list[str], results: dict[str, Any]) -> None:
    """Run every mode (and DiLoCo's ``--outer`` sweep) for ``--quality-steps`` steps, in ``--work``.

    A result already in ``results`` for the same number of steps is kept, not run again; a run
    killed part-way resumes from its checkpoint in ``--work``; ``--out`` is rewritten after every
    run. So the full-length study (about 48 min per run here) can be spread over several sittings:
    run the same command again.

    With ``--seed`` other than :data:`SEED` the runs are repeats: kept in ``results["repeats"]`` under
    ``"<label> seed <N>"``, never in ``quality`` or the sweep, so that the best of the sweep is not
    picked across seeds and every ratio to grad mode stays one of the same seed.
    """
    same = lambda v: (v.get("steps") == a.quality_steps and v.get("corpus", "pydoc") == a.corpus  # noqa: E731
                      and v.get("workers", 2) == a.workers)
    keep = lambda d: {k: v for k, v in d.items() if same(v)}  # noqa: E731
    results["quality"], results["diloco_sweep"] = keep(results.get("quality", {})), keep(results.get("diloco_sweep", {}))
    results["repeats"] = keep(results.get("repeats", {}))
    repeat = a.seed != SEED
    outers = [tuple(float(x) for x in o.split(":")) for o in a.outer.split(",") if o]
    for mode in modes:
        for outer in outers if mode.startswith("diloco") else [None]:
            label = mode if outer is None else f"{mode} lr {outer[0]:g} m {outer[1]:g}"
            label += f" seed {a.seed}" if repeat else ""
            if label in (results["repeats"] if repeat else results["quality"] if outer is None else results["diloco_sweep"]):
                print(f"quality {label:26} kept from {a.out}", flush=True)
                continue
            workers = "" if a.workers == 2 else f"-w{a.workers}"
            out = os.path.join(a.work, f"q{a.quality_steps}-{a.corpus}{workers}-{label.replace(' ', '_')}")
            started = time.monotonic()
            q = quality_run(mode, a.quality_steps, out, outer, a.corpus, a.seed, a.workers)  # type: ignore[arg-type]
            shutil.rmtree(out, ignore_errors=True)
            print(f"quality {label:26} eval loss {q['eval_loss']:.4f} after {q['steps']} steps "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
            settings = {"outer_lr": outer[0], "outer_momentum": outer[1]} if outer else {}
            if repeat:
                results["repeats"][label] = {**q, **settings, "seed": a.seed}
            elif outer is None:
                results["quality"][mode] = q
            else:
                results["diloco_sweep"][label] = {**q, **settings}
                # the best of the sweep so far stands for DiLoCo
                results["quality"][mode] = min((v for k, v in results["diloco_sweep"].items() if k.startswith(mode + " ")),
                                               key=lambda v: v["eval_loss"])
            write(results, a.out)


def write(results: dict[str, Any], path: str) -> None:
    """Derive the model and the ratios, then write ``path`` and its PNG plot."""
    model(results)
    q = results["quality"]
    if "grad" in q:
        results["quality_vs_grad"] = {m: v["eval_loss"] / q["grad"]["eval_loss"] for m, v in q.items()}
    rep = results.get("repeats", {})
    if rep:  # a repeat against grad mode of its own seed
        results["repeats_vs_grad"] = {k: v["eval_loss"] / rep[f"grad seed {v['seed']}"]["eval_loss"]
                                      for k, v in rep.items() if f"grad seed {v['seed']}" in rep}
    s = results["speed"].get("ddp", {})
    if "grad" in s:
        results["speed_vs_grad"] = {m: {r: v[r]["samples_per_s"] / s["grad"][r]["samples_per_s"] for r in v if r in s["grad"]}
                                    for m, v in s.items()}
        results["speed_vs_unshaped"] = {m: {r: v[r]["samples_per_s"] / v["0"]["samples_per_s"] for r in v}
                                        for m, v in s.items() if "0" in v}
        runs = {m: {r: x["samples_per_s_runs"] for r, x in v.items() if len(x.get("samples_per_s_runs", [])) > 1}
                for m, v in s.items()}
        if any(runs.values()):  # --repeats: the spread of the ratios, each taken within one round
            results["speed_vs_grad_rounds"] = {m: {r: round_ratios(x, runs["grad"][r]) for r, x in v.items()
                                                   if r in runs.get("grad", {})} for m, v in runs.items()}
            results["speed_vs_unshaped_rounds"] = {m: {r: round_ratios(x, v["0"]) for r, x in v.items()}
                                                   for m, v in runs.items() if "0" in v}
        else:  # a sweep without repeats leaves no stale spread from an earlier one
            results.pop("speed_vs_grad_rounds", None)
            results.pop("speed_vs_unshaped_rounds", None)
    if "mpi" in results["speed"] and "grad" in s:
        results["mpi_vs_ddp_grad"] = {r: v["samples_per_s"] / s["grad"][r]["samples_per_s"]
                                      for r, v in results["speed"]["mpi"]["grad"].items() if r in s["grad"]}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)  # a kill mid-write leaves the previous file whole
    plot(results, os.path.splitext(path)[0] + ".png")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--rates", default="25,100,1000,0", help="link speeds in Mbit/s; 0 = unshaped")
    p.add_argument("--modes", default="grad,param10,param100,param500,diloco100")
    p.add_argument("--engines", default="ddp,mpi", help="speed runs: ddp (torchrun) and/or mpi (mpirun); "
                                                        "the mpi engine runs grad mode only")
    p.add_argument("--speed-steps", type=int, default=40, help="steps of a speed run (at least H in param mode)")
    p.add_argument("--quality-steps", type=int, default=1500)
    p.add_argument("--corpus", default="pydoc", choices=("pydoc", "stdlib"),
                   help="charlm's text for the quality runs (stdlib: long runs that must not repeat the data)")
    p.add_argument("--outer", default="0.7:0.9,1.0:0.5,0.5:0.0", help="DiLoCo outer lr:momentum values to sweep")
    p.add_argument("--seed", type=int, default=SEED,
                   help=f"quality runs' seed; another than {SEED} makes them repeats that show the seed-to-seed spread")
    p.add_argument("--repeats", type=int, default=1,
                   help="speed sweeps to run, in rounds; each row keeps the median run, and the ratios' spread is reported")
    p.add_argument("--only", choices=("speed", "quality"), default=None)
    p.add_argument("--workers", type=int, default=2,
                   help="quality runs' ranks (--nprocs; batch 16 per rank); speed runs are 2 hosts x 1 rank")
    p.add_argument("--out", default=os.path.join(RESULTS, "slow_link.json"))
    p.add_argument("--work", default=os.path.join(ROOT, "runs", "slow_link_quality"),
                   help="quality runs' directories (kept until a run finishes, so a killed run resumes)")
    a = p.parse_args()
    rates = [r.strip() for r in a.rates.split(",") if r.strip()]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = []
    for m in modes:
        try:
            sync_period(m)
        except ValueError:
            bad.append(m)
    if bad:
        print(f"slow_link: unknown mode {bad[0]!r}: use grad, param<H> or diloco<H>, optionally with -f<F>, "
              f"-bf16/-fp16/-int8/-int4/-e3m0/-tk<percent>b<bits> and -o<tau> (e.g. diloco100-f4-int8-o5, diloco100-tk1b2)", file=sys.stderr)
        return 2
    try:
        if any(float(r) < 0 for r in rates):
            raise ValueError
    except ValueError:
        print(f"slow_link: --rates {a.rates!r}: give link speeds in Mbit/s, 0 for unshaped (e.g. 25,100,0)", file=sys.stderr)
        return 2
    if a.workers < 1:
        print(f"slow_link: --workers {a.workers}: give 1 or more ranks for the quality runs", file=sys.stderr)
        return 2
    if a.repeats < 1:
        print(f"slow_link: --repeats {a.repeats}: give 1 or more speed sweeps", file=sys.stderr)
        return 2
    if importlib.util.find_spec("matplotlib") is None:  # checked now: the plot is drawn after each (long) run
        print("slow_link: needs matplotlib for its plot: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"workload": "charlm medium, batch 16 per rank, Adam lr 0.003, seed 42",
                               "speed": {}, "quality": {}}
    if os.path.exists(a.out):  # keep the part not re-run
        with open(a.out) as f:
            old = json.load(f)
        results.update({k: v for k, v in old.items() if k in ("speed", "quality", "diloco_sweep", "repeats")})
    work = tempfile.mkdtemp(prefix="slow_link_")
    try:
        if a.only != "quality":
            problem = nethosts.unavailable()
            if problem:
                print(f"slow_link: {problem}", file=sys.stderr)
                return 2
            runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
            for rnd in range(a.repeats):
                for rate in rates:
                    with nethosts.Hosts(2, rate_mbit=float(rate) or None) as h:
                        for engine in a.engines.split(","):
                            for mode in modes if engine == "ddp" else ["grad"]:
                                steps = max(a.speed_steps, sync_period(mode) + WARMUP)
                                out = os.path.join(work, f"{engine}-{mode}-{rate}")
                                r = speed_run(h, engine, mode, steps, out, work)
                                shutil.rmtree(out, ignore_errors=True)
                                runs.setdefault((engine, mode, rate), []).append(r)
                                tag = f"round {rnd + 1}/{a.repeats} " if a.repeats > 1 else ""
                                print(f"{tag}{f'{rate} Mbit/s' if float(rate) else 'unshaped':>13} {engine:4} {mode:10} {r['samples_per_s']:7.1f} "
                                      f"samples/s {r['step_time_s']:.3f} s/step  {r['iface_bytes_per_step'] / 1e6:6.2f} MB/step "
                                      f"on eth0 (distkit payload {r['payload_bytes_per_step'] / 1e6:.2f})", flush=True)
            results["speed"] = {}
            for (engine, mode, rate), rs in runs.items():
                results["speed"].setdefault(engine, {}).setdefault(mode, {})[rate] = rs[0] if len(rs) == 1 else median_run(rs)
        if a.only != "speed":
            quality_part(a, modes, results)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write(results, a.out)
    print(json.dumps({k: results[k] for k in ("quality_vs_grad", "speed_vs_grad", "speed_vs_unshaped", "mpi_vs_ddp_grad",
                                              "framing", "speed_vs_grad_rounds", "speed_vs_unshaped_rounds")
                      if k in results}, indent=1))
    print(f"wrote {a.out} and {os.path.splitext(a.out)[0]}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
