"""param_sync_compression's low-bit and sparse codecs (issue 60 items 1-2): "int4" (symmetric, absmax / 7 per block
of BLOCK4 elements, two values per byte) and "e3m0" (Streaming DiLoCo's 4-bit float: sign and 3-bit exponent, each
value 0 or +-absmax * 2^-e per block of BLOCK4) through the two-phase exchange, and "topk" (per chunk the k largest
magnitudes, int16 indices and 2/4/8-bit values with one fp32 scale per chunk) through an all-gather of every
member's encoding, summed in rank order on every rank. Closed forms of the encodings, their sizes, the error
feedback's identity (what is kept = the pseudo-gradient - what was sent) and the mean on real gloo groups; then
real 2-rank runs on ddp and mpi whose replicas end bit-identical, and a top-k run killed and resumed from a
checkpoint (its per-rank error feedback and an exchange in flight) that ends as the uninterrupted one. Bytes per sync
(the averager's ``sync_bytes``, what ``metrics.jsonl`` and ``distkit plot`` show): each codec's closed form on 2
gloo ranks, blocking and overlapped."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import distkit, final_params, ok, run_ranks, summary
from distkit.sync.compression import (BLOCK, BLOCK4, E3M0_LEVELS, TOPK_DEFAULT, codec_of, decode, encode,
                                      encoded_size, is_sparse, roundtrip, topk_params)


def _quantised(x: torch.Tensor, levels: int) -> torch.Tensor:
    """The closed form of symmetric quantisation of all of ``x`` with one scale absmax / levels."""
    s = x.abs().max() / levels
    return torch.round(x / s) * s


def test_int4_round_trip_closed_form() -> None:
    x = torch.zeros(3 * BLOCK4)
    x[:8] = torch.tensor([7.0, -7.0, 3.5, 2.5, -0.5, 0.5, 1.49, -6.6])  # block 0: scale 7 / 7 = 1
    x[BLOCK4:BLOCK4 + 5] = torch.tensor([14.0, -3.0, 5.0, 1.0, -1.0])  # block 1: scale 14 / 7 = 2
    # block 2: all zeros (scale 1: any scale gives zeros)
    data = encode(x, "int4")
    assert data.dtype == torch.uint8 and data.numel() == encoded_size(x.numel(), "int4") == 3 * BLOCK4 // 2 + 3 * 4
    # two values per byte, q + 8, element 2i in the low nibble
    assert data[:4].tolist() == [(7 + 8) | ((-7 + 8) << 4), (4 + 8) | ((2 + 8) << 4), 8 | (8 << 4),
                                 (1 + 8) | ((-7 + 8) << 4)]
    assert data[-12:].clone().view(torch.float32).tolist() == [1.0, 2.0, 1.0]
    want = torch.zeros(3 * BLOCK4)
    want[:8] = torch.tensor([7.0, -7.0, 4.0, 2.0, 0.0, 0.0, 1.0, -7.0])  # round half to even, as torch.round
    want[BLOCK4:BLOCK4 + 5] = torch.tensor([14.0, -4.0, 4.0, 0.0, 0.0])
    assert torch.equal(decode(data, x.numel(), "int4"), want)
    # any tensor: round(x / s) * s per block, s = absmax / 7 (the last block padded with zeros)
    y = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    y[3] = 50.0  # an outlier costs precision in its own block only
    padded = torch.nn.functional.pad(y, (0, -1000 % BLOCK4)).view(-1, BLOCK4)
    assert torch.equal(roundtrip(y, "int4"), torch.cat([_quantised(b, 7) for b in padded])[:1000])
    assert (roundtrip(y, "int4") - y)[BLOCK4:].abs().max() < 0.5


def _e3m0(x: torch.Tensor) -> torch.Tensor:
    """The closed form of e3m0 on one block: each value the nearest of 0, +-absmax * 2^-e (e = 0..6), by brute force
    over the 8 magnitudes (a tie to the larger)."""
    s = x.abs().max() if x.abs().max() > 0 else torch.tensor(1.0)
    levels = torch.tensor([0.0] + [2.0 ** -e for e in range(6, -1, -1)])
    d = (x.abs()[:, None] / s - levels[None, :]).abs()
    nearest = (d == d.min(dim=1, keepdim=True).values).int().cumsum(dim=1).argmax(dim=1)  # the last of the minima
    return torch.sign(x) * levels[nearest] * s


def test_e3m0_round_trip_closed_form() -> None:
    assert E3M0_LEVELS.tolist() == [0.0] + [2.0 ** -e for e in range(6, -1, -1)]  # codes 0..7
    x = torch.zeros(3 * BLOCK4)
    # block 0: scale 8 (its absmax); ratios 1, -1/2, 1/4, 0.7625 (over 0.75: up to 1), 0.7375 (down to 1/2),
    # 2^-7 (the midpoint of 0 and 2^-6: up), 0.0075 (below it: 0), -0.0125 (nearest 2^-6)
    x[:8] = torch.tensor([8.0, -4.0, 2.0, 6.1, 5.9, 0.0625, 0.06, -0.1])
    x[BLOCK4] = -3.0  # block 1: scale 3; block 2: all zeros (scale 1)
    data = encode(x, "e3m0")
    assert data.dtype == torch.uint8 and data.numel() == encoded_size(x.numel(), "e3m0") == 3 * BLOCK4 // 2 + 3 * 4
    # 4-bit codes (sign << 3 | exponent code), two per byte, element 2i in the low nibble
    assert data[:4].tolist() == [7 | (8 + 6) << 4, 5 | 7 << 4, 6 | 1 << 4, 0 | (8 + 1) << 4]
    assert data[BLOCK4 // 2] == 8 + 7 and data[-12:].clone().view(torch.float32).tolist() == [8.0, 3.0, 1.0]
    want = torch.zeros(3 * BLOCK4)
    want[:8] = torch.tensor([8.0, -4.0, 2.0, 8.0, 4.0, 0.125, 0.0, -0.125])
    want[BLOCK4] = -3.0
    assert torch.equal(decode(data, x.numel(), "e3m0"), want)
    # any tensor: the nearest level per block (the last block padded with zeros); within a third of each value at
    # least 2^-6 of its block's absmax (the largest gap between two levels is at their midpoint: 1/3 of it)
    y = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    y[3] = 50.0
    padded = torch.nn.functional.pad(y, (0, -1000 % BLOCK4)).view(-1, BLOCK4)
    got = roundtrip(y, "e3m0")
    assert torch.equal(got, torch.cat([_e3m0(b) for b in padded])[:1000])
    scale = padded.abs().amax(dim=1).repeat_interleave(BLOCK4)[:1000]
    big = y.abs() >= scale / 64
    assert ((got - y)[big].abs() <= y[big].abs() / 3 + 1e-6).all() and torch.equal(got.sign()[big], y.sign()[big])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_topk_round_trip_closed_form(bits: int) -> None:
    codec = f"topk:0.25:{bits}:8"  # k = 2 of each chunk of 8
    assert topk_params(codec) == (2, bits, 8) and is_sparse(codec)
    x = torch.tensor([1.0, -8.0, 0.5, 3.0, 0.0, 0.0, 2.0, -1.0,
                      0.0, 0.25, 0.0, 0.0, -0.5, 0.0, 0.0, 0.125])
    data = encode(x, codec)
    # per chunk: 2 int16 indices, 2 values in whole bytes, one fp32 scale
    value_bytes = {2: 1, 4: 1, 8: 2}[bits]
    assert data.numel() == encoded_size(16, codec) == 2 * (2 * 2 + value_bytes + 4)
    assert data[:8].clone().view(torch.int16).tolist() == [1, 3, 1, 4]  # the kept indices within each chunk, ascending
    levels = (1 << (bits - 1)) - 1
    want = torch.zeros(16)
    want[[1, 3]] = _quantised(torch.tensor([-8.0, 3.0]), levels)
    want[[9, 12]] = _quantised(torch.tensor([0.25, -0.5]), levels)
    assert torch.equal(decode(data, 16, codec), want)
    # a length that is no multiple of the chunk: padded with zeros, cut again
    assert torch.equal(roundtrip(x[:13], codec), want[:13])


def test_topk_keys_make_one_codec_string() -> None:
    from distkit.config.schema import DistributedConfig

    assert codec_of(DistributedConfig(param_sync_compression="int4")) == "int4"
    d = DistributedConfig(param_sync_compression="topk", param_sync_topk_density=0.01, param_sync_topk_bits=2,
                          param_sync_topk_chunk=4096)
    assert codec_of(d) == "topk:0.01:2:4096" and topk_params(codec_of(d)) == (41, 2, 4096)  # ceil(40.96)
    assert codec_of(DistributedConfig(param_sync_compression="topk")) == TOPK_DEFAULT  # the keys' defaults
    assert topk_params("topk") == topk_params(TOPK_DEFAULT) == (128, 4, 4096)


def test_bytes_per_element() -> None:
    """encoded_size over n, for the report and docs/running.md (fp32: 4)."""
    n = 1 << 20
    per = {c: encoded_size(n, c) / n for c in ("bf16", "int8", "int4", "e3m0", "topk:0.03125:2:4096",
                                                "topk:0.03125:4:4096", "topk:0.03125:8:4096")}
    assert per["bf16"] == 2 and per["int8"] == 1 + 4 / BLOCK and per["int4"] == 0.5 + 4 / BLOCK4 == 0.53125
    assert per["e3m0"] == per["int4"]  # 4 bits per value, one fp32 scale per block of 128
    for bits in (2, 4, 8):  # k = 128 of 4096: 256 bytes of indices, 128 * bits / 8 of values, 4 of scale
        assert per[f"topk:0.03125:{bits}:4096"] == (256 + 16 * bits + 4) / 4096
    assert math.isclose(per["topk:0.03125:2:4096"], 0.0712890625)


CODECS = ("int4", "e3m0", "topk:0.1:2:64", "topk:0.25:4:100", "topk:0.05:8:4096")


def _exchanges(rank: int, world: int) -> dict[str, dict[str, object]]:
    from distkit.sync.compression import Exchange
    from test_averaging import _strategy

    s = _strategy(rank, world)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    out = {}
    for codec in CODECS:
        before = s.comm_bytes
        e = Exchange(s, x, codec)
        mean, sent = e.result(), e.sent
        out[codec] = {"x": x, "mean": mean, "sent": sent, "bytes": s.comm_bytes - before}
    return out


def _error_feedback(rank: int, world: int, codec: str) -> list[dict[str, torch.Tensor]]:
    """Plain averaging, one tensor, 3 syncs: each sync's pseudo-gradient (plus the error carried) and what was kept."""
    from distkit.sync.averager import ParamAverager
    from test_averaging import _strategy

    s = _strategy(rank, world)
    p = torch.nn.Parameter(torch.zeros(300))
    avg = ParamAverager(s, [p], 1, compression=codec)
    seen = []
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(3):
        with torch.no_grad():
            p += torch.randn(300, generator=g)
        carried = avg._error[0] if avg._error is not None else torch.zeros(300)
        delta = (avg._anchor[0] - p).detach().reshape(-1) + carried
        avg.after_step()
        seen.append({"delta": delta, "kept": avg._error[0].clone(), "p": p.detach().clone()})  # type: ignore[index]
    return seen


def test_exchanges_mean_bytes_and_error_feedback_on_2_ranks(tmp_path: Path) -> None:
    got = run_ranks(_exchanges, 2, tmp_path)
    for codec in CODECS:
        r0, r1 = got[0][codec], got[1][codec]
        for r in (r0, r1):
            assert torch.equal(r["sent"], roundtrip(r["x"], codec))  # what the others read of it
        assert torch.equal(r0["mean"], r1["mean"])  # every rank: the same bytes, decoded the same way
        if is_sparse(codec):  # every member's encoding decoded and summed in rank order, then / p
            assert torch.equal(r0["mean"], (r0["sent"] + r1["sent"]) / 2)
            chunk = topk_params(codec)[2]
            assert r0["bytes"] == encoded_size(-(-3000 // chunk) * chunk, codec)  # one all-gather of it
        else:  # the owners' means of the decoded copies, encoded again (chunks of whole blocks)
            assert torch.equal(r0["mean"], roundtrip((r0["sent"] + r1["sent"]) / 2, codec))
            chunk = -(-3000 // (2 * BLOCK4)) * BLOCK4
            assert r0["bytes"] == 3 * encoded_size(chunk, codec)  # the all-to-all's 2 chunks and the gathered one
    # error feedback: what is kept = the pseudo-gradient (with the error carried in) - what was sent; for top-k,
    # everything outside the kept indices exactly; every replica identical after each sync
    for codec in ("int4", "e3m0", "topk:0.1:4:64"):
        runs = run_ranks(_error_feedback, 2, tmp_path, codec)
        for rank in (0, 1):
            for sync in runs[rank]:
                assert torch.equal(sync["kept"], sync["delta"] - roundtrip(sync["delta"], codec))
                if is_sparse(codec):
                    unsent = roundtrip(sync["delta"], codec) == 0
                    assert torch.equal(sync["kept"][unsent], sync["delta"][unsent])
                    assert int(unsent.sum()) >= 300 - 5 * 7  # at most k = 7 of each of the 5 chunks of 64 sent
        assert all(torch.equal(a["p"], b["p"]) for a, b in zip(runs[0], runs[1]))


# -- real runs -----------------------------------------------------------------------------------------------------
TOPK = "'param_sync_compression': 'topk', 'param_sync_topk_density': 0.05, 'param_sync_topk_bits': 2, " \
       "'param_sync_topk_chunk': 512"
PARAM = {
    "int4": "'reduce_type': 'param', 'param_sync_step': 4, 'param_sync_compression': 'int4'",
    # with DiLoCo's outer optimizer and each exchange overlapped with the next 2 steps (the one started at step 8
    # is in flight at the checkpoint)
    "topk": "'reduce_type': 'param', 'param_sync_step': 4, 'outer_optimizer': {'class': 'nesterov', 'lr': 0.7, "
            f"'momentum': 0.9}}, {TOPK}, 'param_sync_overlap': 2",
}
COMMON = ["++max_steps", "12", "++progress_bar", "False", "++log_every", "4", "++checkpoint_every", "8",
          "++optimizer", "{'class': 'sgd', 'momentum': 0.9}"]


def _args(out: Path, engine: str, variant: str) -> list[str]:
    return ["train", "configs/returnn_ddp.py", "--nprocs", "2", "++output_dir", str(out), *COMMON,
            "++distributed", "{'backend': '" + engine + "', " + PARAM[variant] + "}"]


def _sync_records(out: Path) -> list[tuple[int, int, int, float]]:
    """(step, syncs, sync_bytes, bytes_per_sync) of the training records of ``out``'s metrics.jsonl (rank 0's)."""
    import json

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["syncs"], r["sync_bytes"], r["bytes_per_sync"]) for r in records if "loss" in r]


def _payload(variant: str, n: int) -> int:
    """Bytes per sync of ``variant``'s codec for ``n`` parameter elements on 2 ranks (the digits MLP has no floating
    buffers): int4 the all-to-all's 2 chunks and the gathered one, each ``ceil(n / (2 * 128))`` blocks of 128; top-k
    (density 0.05, 2 bits, chunks of 512) one all-gather of its encoding."""
    if variant == "int4":
        return 3 * encoded_size(-(-n // (2 * BLOCK4)) * BLOCK4, "int4")
    return encoded_size(-(-n // 512) * 512, "topk:0.05:2:512")


def _assert_sync_records(out: Path, variant: str) -> None:
    """metrics.jsonl's bytes per sync are the codec's closed form: one sync per log window of 4 steps (syncs every
    4), its payload computed from the model's parameter count."""
    n = sum(t.numel() for t in final_params(out).values() if t.is_floating_point())
    per = _payload(variant, n)
    assert n == 17_226 and per == {"int4": 3 * (8704 // 2 + 4 * 68), "topk": 34 * (2 * 26 + 7 + 4)}[variant]
    assert _sync_records(out) == [(4, 1, per, per), (8, 2, 2 * per, per), (12, 3, 3 * per, per)]


@pytest.mark.parametrize("engine,variant", [("ddp", "int4"), ("ddp", "topk"), ("mpi", "int4"), ("mpi", "topk")])
def test_a_compressed_run_keeps_the_replicas_identical(engine: str, variant: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    ok(distkit(*_args(out, engine, variant), timeout=300))
    s = summary(out)
    assert s["ranks_in_sync"] is True and s["reduce_type"] == "param"
    a, b = final_params(out, 0), final_params(out, 1)
    assert all(a[k].equal(b[k]) for k in a)
    _assert_sync_records(out, variant)


def test_a_topk_run_killed_and_resumed_ends_as_the_uninterrupted_one(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    ok(distkit(*_args(ref, "ddp", "topk"), timeout=300))
    out = tmp_path / "killed"
    killed = distkit(*_args(out, "ddp", "topk"), DISTKIT_FAULT="1:10:kill", timeout=300)
    said = f"exit {killed.returncode}\n{killed.stderr[-3000:]}"
    assert killed.returncode != 0 and "rank 1 failed (killed by SIGKILL)" in killed.stderr, said
    assert (out / "checkpoints" / "latest").read_text() == "step-0000008", said
    ok(distkit(*_args(out, "ddp", "topk"), "++resume", "auto", timeout=300))
    a, b = final_params(ref), final_params(out)
    assert all(a[k].equal(b[k]) for k in a), {k: (a[k] - b[k]).abs().max().item() for k in a}
    assert summary(out)["param_checksum"] == summary(ref)["param_checksum"]
    # the bytes counted: the resumed process continues the checkpoint's count (step 8's, its exchange in flight
    # included), so its record of step 12 is the uninterrupted run's
    _assert_sync_records(ref, "topk")
    assert _sync_records(out) == _sync_records(ref)


# -- bytes per sync (issue 60 item 6: metrics) ---------------------------------------------------------------------
#: codec, param_sync_overlap -> bytes rank 0 hands to the collectives per sync of one fp32 tensor of N_BYTES elements
#: on 2 ranks (the engine's comm_bytes: what it is given, its own chunk of the all-to-all included), by hand:
N_BYTES = 3000
BYTES_PER_SYNC = {
    ("none", 0): 4 * 3000,  # the fp32 all-reduce of the parameters
    ("bf16", 0): 3 * 2 * 1500,  # chunks of 1500: the all-to-all's 2 rows and the gathered one, 2 bytes each
    ("int8", 0): 3 * (2048 + 4 * 2),  # chunks of 2 blocks of 1024 (3000 padded to 4096): 1 byte + a scale per block
    ("int4", 0): 3 * (1536 // 2 + 4 * 12),  # chunks of 12 blocks of 128 (3000 padded to 3072): half a byte + scales
    ("int4", 2): 3 * (1536 // 2 + 4 * 12),  # in the background: the same bytes, the second phase a step later
    ("e3m0", 0): 3 * (1536 // 2 + 4 * 12),  # int4's layout: 4-bit codes, one fp32 scale per block of 128
    # 12 chunks of 256 (3072), k = ceil(256 / 32) = 8 per chunk: 8 int16 indices, 8 2-bit values (2 bytes), a scale
    ("topk:0.03125:2:256", 0): 12 * (2 * 8 + 2 + 4),
    ("topk:0.03125:2:256", 2): 12 * (2 * 8 + 2 + 4),
}


def _sync_bytes(rank: int, world: int, codec: str, overlap: int) -> tuple[list[int], int, float]:
    """9 steps of a ParamAverager (a sync every 3) and its final sync: ``sync_bytes`` after each step, the sync
    events counted, ``bytes_per_sync``."""
    from distkit.sync.averager import ParamAverager
    from test_averaging import _strategy

    s = _strategy(rank, world)
    p = torch.nn.Parameter(torch.zeros(N_BYTES))
    avg = ParamAverager(s, [p], 3, compression=codec, overlap=overlap)
    seen = []
    g = torch.Generator().manual_seed(rank)
    for _ in range(9):
        with torch.no_grad():
            p += torch.randn(N_BYTES, generator=g)
        avg.after_step()
        seen.append(avg.sync_bytes)
    avg.final_sync()  # (the exchange in flight applied: no new bytes; none with steps since the last sync)
    seen.append(avg.sync_bytes)
    return seen, avg.process_syncs, avg.bytes_per_sync


@pytest.mark.parametrize("codec,overlap", list(BYTES_PER_SYNC))
def test_bytes_per_sync_is_the_codecs_encoded_size(codec: str, overlap: int, tmp_path: Path) -> None:
    per = BYTES_PER_SYNC[codec, overlap]
    if is_sparse(codec):  # the same numbers from the codec's own size function: one all-gather of the encoding
        unit = topk_params(codec)[2]
        assert per == encoded_size(-(-N_BYTES // unit) * unit, codec)
    elif codec != "none":  # p + 1 chunks of ceil(n / (p * unit)) units (p = 2)
        unit = {"int4": BLOCK4, "e3m0": BLOCK4, "int8": BLOCK}.get(codec, 1)
        assert per == 3 * encoded_size(-(-N_BYTES // (2 * unit)) * unit, codec)
    for seen, syncs, mean in run_ranks(_sync_bytes, 2, tmp_path, codec, overlap):
        assert syncs == 3 and mean == per and seen[-1] == 3 * per
        if overlap == 0 or is_sparse(codec):  # each sync's bytes at its step (3, 6, 9)
            assert seen == [0, 0, per, per, per, 2 * per, 2 * per, 2 * per, 3 * per, 3 * per]
        else:  # the all-to-all at the sync's step, the all-gather tau // 2 = 1 step later; the last by final_sync
            a2a = per * 2 // 3
            assert seen == [0, 0, a2a, per, per, per + a2a, 2 * per, 2 * per, 2 * per + a2a, 3 * per]
