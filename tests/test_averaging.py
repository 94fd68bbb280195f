"""Parameter averaging: closed forms on real gloo process groups."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from conftest import run_ranks


def _strategy(rank: int, world: int, reduce_type: str = "param"):  # type: ignore[no-untyped-def]
    from distkit.backends.ddp import DDPStrategy
    from distkit.config import resolve
    from distkit.env import ClusterEnv

    cfg = resolve({"torch_distributed": {"reduce_type": reduce_type, "param_sync_step": 1}})
    env = ClusterEnv(rank, rank, world, world, 0, 1, None, None, "env", None, None)
    s = DDPStrategy(cfg, env, torch.device("cpu"))
    s.init()  # the process group exists already (run_ranks): init() reuses it
    return s


def _average_rank_ones(rank: int, world: int) -> list[list[float]]:
    s = _strategy(rank, world)
    tensors = [torch.full((3, 2), float(rank)), torch.full((5,), float(rank) * 2)]
    s.average_parameters(tensors)
    return [t.reshape(-1).tolist() for t in tensors]


def test_average_closed_form_2_and_3_ranks(tmp_path: Path) -> None:
    for world in (2, 3):
        mean = sum(range(world)) / world
        for got in run_ranks(_average_rank_ones, world, tmp_path):
            assert got[0] == [mean] * 6
            assert got[1] == [2 * mean] * 5


def _averager_steps(rank: int, world: int, sync_step: int, steps: int) -> tuple[int, list[float]]:
    from distkit.sync.averager import ParamAverager

    s = _strategy(rank, world)
    p = torch.zeros(4)
    avg = ParamAverager(s, [p], sync_step)
    for _ in range(steps):
        p += rank + 1  # each rank drifts differently
        avg.after_step()
    avg.final_sync()
    return avg.num_syncs, p.tolist()


def test_sync_every_k_steps_and_final_sync(tmp_path: Path) -> None:
    # 7 steps, sync every 3: syncs after steps 3 and 6, then the final sync for step 7.
    res = run_ranks(_averager_steps, 2, tmp_path, 3, 7)
    assert [r[0] for r in res] == [3, 3]
    # every step adds rank+1 = 1 or 2; averaged: 1.5 per step, exactly
    assert res[0][1] == res[1][1] == [1.5 * 7] * 4


def _time_based(rank: int, world: int) -> int:
    from distkit.sync.averager import ParamAverager

    s = _strategy(rank, world)
    p = torch.zeros(2)
    avg = ParamAverager(s, [p], sync_step=1, sync_time_diff=0.2)
    for _ in range(12):
        time.sleep(0.05 * (rank + 1))  # rank 1's clock would fire at other steps than rank 0's
        p += rank
        avg.after_step()
    return avg.num_syncs


def test_time_based_decision_is_identical_on_all_ranks(tmp_path: Path) -> None:
    syncs = run_ranks(_time_based, 2, tmp_path)
    assert syncs[0] == syncs[1] and syncs[0] >= 2  # same count: otherwise the job would hang


def _outer(rank: int, world: int, lr: float, momentum: float) -> list[float]:
    from distkit.sync.averager import ParamAverager

    s = _strategy(rank, world)
    p = torch.nn.Parameter(torch.ones(3), requires_grad=False)  # a parameter (the outer optimizer steps it)
    buffer = torch.ones(2)  # a floating buffer (BatchNorm's running statistics): averaged, never stepped
    avg = ParamAverager(s, [p, buffer], 1, outer_optimizer={"class": "nesterov", "lr": lr, "momentum": momentum})
    for _ in range(2):
        p -= rank + 1  # local update: rank 0 -> 0, rank 1 -> -1; mean = -0.5, pseudo-gradient 1.5
        buffer -= rank + 1
        avg.after_step()
    return [p.tolist(), buffer.tolist()]


def test_outer_nesterov_closed_form(tmp_path: Path) -> None:
    # lr 1, momentum 0: plain averaging (two syncs, each moving by the mean update -1.5).
    assert run_ranks(_outer, 2, tmp_path, 1.0, 0.0) == [[[-2.0] * 3, [-2.0] * 2]] * 2
    # Nesterov, torch SGD's formula: step 1 buf = g = 1.5, update g + 0.9 buf = 2.85: anchor 1 - 0.7 * 2.85;
    # step 2 buf = 0.9 * 1.5 + 1.5 = 2.85, update 1.5 + 0.9 * 2.85. The buffer: the plain mean each time
    # (issue 57 E: momentum extrapolated BatchNorm's running variance below zero).
    a1 = 1 - 0.7 * 1.9 * 1.5
    a2 = a1 - 0.7 * (1.5 + 0.9 * 2.85)
    for p, buffer in run_ranks(_outer, 2, tmp_path, 0.7, 0.9):
        assert torch.allclose(torch.tensor(p), torch.full((3,), a2)), p
        assert buffer == [-2.0, -2.0], buffer


def _fragments(rank: int, world: int, outer: bool) -> dict[str, object]:
    """Four tensors in 2 fragments, H = 4, 11 steps: each step every element of rank r grows by r + 1."""
    from distkit.sync.averager import ParamAverager

    s = _strategy(rank, world)
    tensors = [torch.nn.Parameter(torch.zeros(*shape), requires_grad=False) for shape in ((6,), (2, 5), (3,), (9,))]
    oo = {"class": "nesterov", "lr": 0.7, "momentum": 0.9} if outer else None
    avg = ParamAverager(s, tensors, 4, outer_optimizer=oo, fragments=2)
    synced, values = [], []
    for _ in range(11):
        for t in tensors:
            t += rank + 1
        did = avg.after_step()
        synced.append([k for k in range(2) if did and avg.fragment_since[k] == 0])
        values.append([t.reshape(-1)[0].item() for t in tensors])
    return {"fragments": avg.fragment_tensors, "synced": synced, "values": values, "num_syncs": avg.num_syncs}


def test_fragments_sync_in_turn_each_every_h_steps_closed_form(tmp_path: Path) -> None:
    # sizes 6, 10, 3, 9 (28): fragment 0 = tensors 0, 1 (16), fragment 1 = tensors 2, 3 (12). Offsets 0 and
    # 4 // 2 = 2: fragment 1 syncs at steps 2, 6, 10, fragment 0 at 4, 8.
    got = run_ranks(_fragments, 2, tmp_path, False)
    assert got[0]["fragments"] == [[0, 1], [2, 3]]
    assert got[0]["synced"] == [[], [1], [], [0], [], [1], [], [0], [], [1], []] == got[1]["synced"]
    assert got[0]["num_syncs"] == 5
    for s in range(1, 12):
        last = {0: max([t for t in (4, 8) if t <= s], default=0), 1: max([t for t in (2, 6, 10) if t <= s], default=0)}
        for rank in (0, 1):
            # the mean drift (1.5 per step) up to the fragment's last sync, the rank's own (r + 1) since
            want = [1.5 * last[f] + (rank + 1) * (s - last[f]) for f in (0, 0, 1, 1)]
            assert got[rank]["values"][s - 1] == want, (s, rank)


def test_fragments_outer_nesterov_is_torchs_sgd_per_fragment(tmp_path: Path) -> None:
    got = run_ranks(_fragments, 2, tmp_path, True)
    # reference: each fragment's tensors follow torch's own Nesterov SGD on their anchor at that fragment's syncs
    anchors = {f: torch.zeros(1) for f in (0, 1)}
    outers = {f: torch.optim.SGD([anchors[f]], lr=0.7, momentum=0.9, nesterov=True) for f in (0, 1)}
    local = {f: [torch.zeros(1), torch.zeros(1)] for f in (0, 1)}  # per rank, the element's value
    for s in range(1, 12):
        for f in (0, 1):
            for r in (0, 1):
                local[f][r] += r + 1
        for f in got[0]["synced"][s - 1]:
            mean = (local[f][0] + local[f][1]) / 2
            anchors[f].grad = anchors[f] - mean
            outers[f].step()
            local[f] = [anchors[f].detach().clone(), anchors[f].detach().clone()]
        for r in (0, 1):
            assert got[r]["values"][s - 1] == [local[f][r].item() for f in (0, 0, 1, 1)], (s, r)


def _compressed(rank: int, world: int) -> dict[str, dict[str, object]]:
    from distkit.sync.compression import Exchange

    s = _strategy(rank, world)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3000, generator=g) * (rank + 1)
    x[7] = 1000.0 * (rank + 1)  # an outlier: it costs precision in its own block of 1024 only
    out = {}
    for codec in ("bf16", "fp16", "int8"):
        before = s.comm_bytes
        e = Exchange(s, x, codec)  # both phases at once: the mean, and what the others read of this rank's x
        mean, sent = e.result(), e.sent
        out[codec] = {"x": x, "mean": mean, "sent": sent, "bytes": s.comm_bytes - before}
    return out


def test_compressed_mean_closed_forms(tmp_path: Path) -> None:
    from distkit.sync.compression import BLOCK, encoded_size, roundtrip

    runs = {world: run_ranks(_compressed, world, tmp_path) for world in (2, 3)}
    for world, codec, bytes_per in ((2, "bf16", 2), (2, "fp16", 2), (2, "int8", 1), (3, "bf16", 2), (3, "int8", 1)):
        got = [r[codec] for r in runs[world]]
        xs = [r["x"] for r in got]
        true = sum(xs) / world
        for r in got:
            assert torch.equal(r["mean"], got[0]["mean"])  # every rank: the same bytes decoded
            assert torch.equal(r["sent"], roundtrip(r["x"], codec))  # what the others read of it
        # two roundings (each rank's contribution, then the owner's mean) bound the error
        if codec == "int8":
            for lo in range(0, 3000, BLOCK):
                hi = min(lo + BLOCK, 3000)
                step = max(x[lo:hi].abs().max() for x in xs) / 127  # the coarsest scale of the block
                assert (got[0]["mean"][lo:hi] - true[lo:hi]).abs().max() <= step + 1e-5, (world, lo)
            # the outlier's block is coarse; the others keep their precision
            assert (got[0]["mean"][BLOCK:] - true[BLOCK:]).abs().max() < 0.1
        else:
            rel = 2 ** -7 if codec == "bf16" else 2 ** -10
            assert ((got[0]["mean"] - true).abs() <= 2.01 * rel * (sum(x.abs() for x in xs) / world + true.abs())).all()
        # bytes: the all-to-all rows (p chunks) and the gathered chunk, each chunk a whole number of blocks
        unit = BLOCK if codec == "int8" else 1
        chunk = -(-3000 // (world * unit)) * unit
        assert got[0]["bytes"] == (world + 1) * encoded_size(chunk, codec)
        assert encoded_size(chunk, codec) <= chunk * bytes_per * (1 + 4 / BLOCK)


def _error_feedback(rank: int, world: int) -> list[list[float]]:
    """Plain averaging with int8 and error feedback, one tensor, 3 syncs: each rank's pseudo-gradients."""
    from distkit.sync.averager import ParamAverager

    s = _strategy(rank, world)
    p = torch.nn.Parameter(torch.zeros(4))
    avg = ParamAverager(s, [p], 1, compression="int8")
    seen = []
    for k in range(3):
        with torch.no_grad():
            p += torch.tensor([0.001, 1.0, -0.5, 0.3]) * (rank + 1) * (k + 1)
        avg.after_step()
        seen.append(avg._error[0].tolist())  # type: ignore[index]
    return seen


def test_error_feedback_carries_what_int8_could_not_send(tmp_path: Path) -> None:
    # 0.001 next to 1.0 in one block rounds to 0 (scale 1/127): without feedback it would never be sent
    got = run_ranks(_error_feedback, 2, tmp_path)
    for rank, errors in enumerate(got):
        assert abs(errors[0][0] + 0.001 * (rank + 1)) < 1e-7  # first sync: its whole pseudo-gradient held back
        assert all(abs(e) <= (rank + 1) * 3 / 127 / 2 + 1e-6 for es in errors for e in es)  # at most half a step


def _overlapped(rank: int, world: int, outer: bool) -> list[list[float]]:
    """One tensor, H = 4, tau = 2, 11 steps then the final sync: each step every element of rank r grows by r + 1."""
    from distkit.sync.averager import ParamAverager

    s = _strategy(rank, world)
    p = torch.nn.Parameter(torch.zeros(3))
    oo = {"class": "nesterov", "lr": 0.7, "momentum": 0.9} if outer else None
    avg = ParamAverager(s, [p], 4, outer_optimizer=oo, overlap=2)
    values = []
    for _ in range(11):
        with torch.no_grad():
            p += rank + 1
        avg.after_step()
        values.append(p.tolist())
    avg.final_sync()
    values.append(p.tolist())
    return values


def test_an_overlapped_exchange_is_applied_tau_steps_later_keeping_local_progress(tmp_path: Path) -> None:
    # exchanges start at steps 4 and 8 (what the ranks held then) and are applied at 6 and 10: the mean then, plus
    # each rank's own progress since the start. Closed form: 1.5 * L + (r + 1) * (s - L), L the last start applied.
    got = run_ranks(_overlapped, 2, tmp_path, False)
    for s in range(1, 12):
        last = max([k for k in (4, 8) if k + 2 <= s], default=0)
        for rank in (0, 1):
            assert got[rank][s - 1] == [1.5 * last + (rank + 1) * (s - last)] * 3, (s, rank)
    assert got[0][-1] == got[1][-1] == [1.5 * 11] * 3  # the end: the exchange in flight applied, then all synced


def test_an_overlapped_outer_step_is_torchs_sgd_on_the_mean_of_the_start(tmp_path: Path) -> None:
    got = run_ranks(_overlapped, 2, tmp_path, True)
    anchor = torch.zeros(1)
    outer = torch.optim.SGD([anchor], lr=0.7, momentum=0.9, nesterov=True)
    local = [torch.zeros(1), torch.zeros(1)]
    started: dict[int, list[torch.Tensor]] = {}
    for s in range(1, 12):
        local = [local[r] + r + 1 for r in (0, 1)]
        if s - 2 in started:  # applied: the anchor's Nesterov step on the mean pseudo-gradient of the start
            before = started.pop(s - 2)
            anchor.grad = anchor.detach() - (before[0] + before[1]) / 2
            outer.step()
            local = [anchor.detach() + (local[r] - before[r]) for r in (0, 1)]
        if s % 4 == 0:
            started[s] = [t.clone() for t in local]
        for r in (0, 1):
            assert got[r][s - 1] == [local[r].item()] * 3, (s, r)


class _OneRank:
    """What DeepSpeed's master averager asks of its engine for a compressed exchange on one rank (no collective)."""

    comm_bytes = 0

    def averaging_size(self) -> int:
        return 1


def _master_averagers(overlap: int) -> tuple[Any, Any, list[torch.Tensor], list[torch.Tensor], list[tuple[int, int]]]:
    """Two DeepSpeed master averagers on one rank: ``old`` over two flat partitions (the layout before issue 60's
    views), ``new`` over per-parameter views into a copy of them, in another order than the partitions' (as AdamW's
    weight-decay groups order them), one parameter empty (frozen)."""
    from distkit.backends.deepspeed.groups import _MasterAverager
    from distkit.backends.deepspeed.state import _ViewAverager

    kw = dict(sync_step=2, compression="int4", outer_optimizer={"class": "nesterov", "lr": 0.7, "momentum": 0.9},
              overlap=overlap)
    g = torch.Generator().manual_seed(0)
    flats = [torch.randn(300, generator=g), torch.randn(140, generator=g)]
    where = [(1, 0), (0, 0), (1, 60), (0, 120)]  # (partition, offset) per parameter, the model's order
    sizes = [60, 120, 80, 180]
    copies = [f.clone() for f in flats]
    views = [copies[p].narrow(0, o, n) for (p, o), n in zip(where, sizes)]
    views.insert(2, torch.empty(0))  # a frozen parameter: no master on this rank
    old = _MasterAverager(_OneRank(), flats, [], lambda: None, [], **kw)
    new = _ViewAverager(copies, _OneRank(), views, [], lambda: None, [], **kw)
    return old, new, flats, views, where


def test_deepspeed_master_views_load_a_checkpoint_of_flat_partitions() -> None:
    """A compressed DeepSpeed run's rank-file state from before the per-parameter views (per flat partition) loads
    into the views: anchor, error feedback and outer momentum each parameter's slice of its partition, bit for bit;
    an overlapped exchange in flight then applies to each view what it applies to the view's elements of the
    partitions."""
    old, new, flats, views, where = _master_averagers(overlap=2)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):  # two syncs: error feedback and momentum exist, one exchange in flight
        with torch.no_grad():
            for f in flats:
                f.add_(0.01 * torch.randn(f.shape, generator=g))
        old.after_step()
    state = old.state_dict()
    assert len(state["error"]) == 2 and state["in_flight"]
    new.load_state_dict(state)
    parts: list[Any] = [*where[:2], None, *where[2:]]  # per view: its partition and offset (None: the empty one)
    for i, w in enumerate(parts):
        if w is None:
            assert new._error[i].numel() == 0 and new._anchor[i].numel() == 0
            continue
        p, o = w
        n = views[i].numel()
        assert torch.equal(new._error[i], old._error[p][o:o + n])
        assert torch.equal(new._anchor[i], old._anchor[p][o:o + n])
        assert torch.equal(new._outer.state[new._anchor[i]]["momentum_buffer"],
                           old._outer.state[old._anchor[p]]["momentum_buffer"][o:o + n])
    with torch.no_grad():  # the views' tensors: the flats' (as DeepSpeed's engine would have them on resume)
        for i, w in enumerate(parts):
            if w is not None:
                views[i].copy_(flats[w[0]][w[1]:w[1] + views[i].numel()])
    before = [f.clone() for f in flats]
    for _ in range(2):  # the exchange in flight moves on, and is applied at the second step
        old.after_step()
        new.after_step()
    assert not any(torch.equal(a, b) for a, b in zip(flats, before))  # (it moved them)
    for i, w in enumerate(parts):
        if w is not None:
            assert torch.equal(views[i], flats[w[0]][w[1]:w[1] + views[i].numel()]), i
