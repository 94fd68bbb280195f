"""The fsdp engine (FSDP2's ``fully_shard``, issue 38): one step against a one-process full-batch reference (the
torch-version guard of item 9, also under hybrid sharding), param mode against ddp's number for number, GPT-2 in an
own loop against ddp, and its bad input (one line, exit 2). Elsewhere: ``distkit train`` in grad mode and checkpoints
that move to and from every engine and world size (test_portable.py), real models (test_real_models.py), the
conformance rows (test_conformance.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from conftest import BIN, ROOT, distkit, final_params, max_abs_diff, ok, run, summary
import tiers  # (a hand-written tier reason is one of its constants: an unknown one makes the test serial)

sys.path.insert(0, str(ROOT / "tests" / "fsdp"))
import reference  # noqa: E402

ARGS = ["train", str(ROOT / "configs" / "returnn_ddp.py"), "++max_steps", "20", "++checkpoint_every", "10",
        "++log_every", "10", "++progress_bar", "False", "++optimizer", "{'class': 'adam'}", "++learning_rate", "0.002"]
GLOBAL_BATCH = 24


@pytest.mark.parametrize("nprocs,shard", [(2, None), (3, None), (4, 2)], ids=["2ranks", "3ranks", "hsdp-2x2"])
def test_one_step_equals_the_one_process_full_batch_step(tmp_path: Path, nprocs: int, shard: Optional[int]) -> None:
    """Whole gradients, the clipped norm and the parameters after one SGD step, against the same step in one process
    on the whole batch (uneven shards: 15 and 13 rows over 2 and 3 ranks; HSDP: 2 groups of 2 ranks, sharded inside
    a group, replicated across). Measured: within 6e-8."""
    out = tmp_path / "fsdp.pt"
    dist = "{'backend': 'fsdp'" + (f", 'fsdp': {{'shard_group_size': {shard}}}" if shard else "") + "}"
    res = run([str(BIN / "python"), str(ROOT / "tests" / "fsdp" / "reference.py"), "--out", str(out),
               "--nprocs", str(nprocs), "++distributed", dist, "++progress_bar", "False",
               "++output_dir", str(tmp_path / "run")], timeout=240)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    got, want = torch.load(out, weights_only=False), reference.reference()
    assert got["world_size"] == nprocs and set(got["kinds"].values()) == {"DTensor"}, got["kinds"]
    assert got["mesh"] == ([nprocs // shard, shard] if shard else [nprocs])
    for part in ("grads", "params"):
        assert got[part].keys() == want[part].keys()
        err = max(float((got[part][n] - want[part][n]).abs().max()) for n in want[part])
        assert err <= 1e-6, f"{part}: {err} from the one-process reference"
    assert abs(got["norm"] - want["norm"]) <= 1e-6 * want["norm"]
    s = got["summary"]
    assert s["backend"] == "fsdp" and "FSDP2" in s["backend_impl"] and s["ranks_in_sync"] is True


PARAM = "'reduce_type': 'param', 'param_sync_step': 5"
PARAM_CASES = {
    # one rank per replica group: FSDP2 on one rank each, averaged every 5 steps, as ddp's param mode
    "plain": (2, PARAM),
    # the exchange every engine has: DiLoCo's outer optimizer, 2 fragments, int8 with error feedback, overlapped 1 step
    "diloco-int8-overlap": (2, PARAM + ", 'outer_optimizer': {'class': 'nesterov', 'lr': 0.7, 'momentum': 0.9}, "
                               "'param_sync_fragments': 2, 'param_sync_compression': 'int8', 'param_sync_overlap': 1"),
    # 2 replica groups of 2 ranks: sharded inside a group, each shard averaged with its peer in the other group
    "groups-2x2": (4, PARAM + ", 'param_sync_group_size': 2"),
}


@pytest.mark.parametrize("case", list(PARAM_CASES))
def test_param_mode_gives_ddps_param_mode(tmp_path: Path, case: str) -> None:
    """Param mode on fsdp against ddp's, same config: the final model, every rank in sync, the same evaluation."""
    nprocs, dist = PARAM_CASES[case]
    outs = {}
    for engine in ("ddp", "fsdp"):
        outs[engine] = tmp_path / engine
        ok(distkit(*ARGS, "--nprocs", str(nprocs), "++batch_size", str(GLOBAL_BATCH // nprocs), "++distributed",
                   "{'backend': '" + engine + "', " + dist + "}", "++output_dir", str(outs[engine])))
    got, want = summary(outs["fsdp"]), summary(outs["ddp"])
    assert got["reduce_type"] == "param" and got["ranks_in_sync"] is True and got["steps"] == 20
    assert max_abs_diff(final_params(outs["fsdp"]), final_params(outs["ddp"])) <= 1e-6
    assert abs(got["eval_loss"] - want["eval_loss"]) <= 1e-6


BAD = [
    (["++distributed", "{'backend': 'fsdp', 'fsdp': {'unitz': ['Linear']}}"], "'distributed.fsdp' has no key 'unitz'"),
    (["++distributed", "{'backend': 'fsdp', 'fsdp': {'param_dtype': 'int8'}}"], "'distributed.fsdp.param_dtype' must"),
    (["++distributed", "{'backend': 'fsdp', 'fsdp': {'units': ['Block']}}"], "names no module of the model"),
    (["++distributed", "{'backend': 'ddp', 'fsdp': {'cpu_offload': True}}"], "applies to backend 'fsdp' only"),
    (["++distributed", "{'backend': 'fsdp', 'reduce_type': 'param', 'fsdp': {'shard_group_size': 2}}"],
     "set distributed.param_sync_group_size instead"),
    (["++distributed", "{'backend': 'fsdp', 'options': {'bucket_cap_mb': 5}}"], "takes its options in distributed.fsdp"),
]


@pytest.mark.parametrize("extra,line", BAD, ids=[b[1].split("'")[1] if "'" in b[1] else b[1][:20] for b in BAD])
def test_bad_fsdp_options_are_one_line_and_exit_2(tmp_path: Path, extra: list[str], line: str) -> None:
    out = tmp_path / "out"
    res = distkit(*ARGS, "--nprocs", "2", "++output_dir", str(out), *extra)
    assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if line in ln]
    assert lines and "Traceback" not in res.stderr, (res.stdout + res.stderr)[-3000:]
    assert not (out / "checkpoints").exists()


OWN_LOOP = '''
import argparse, json, sys, torch, distkit
from distkit.config.loader import load_file

parser = argparse.ArgumentParser()
parser.add_argument("--out")
distkit.add_arguments(parser)
args = parser.parse_args()
cfg = load_file("CONFIG")
dk = distkit.init(args)
model = cfg["model"]()
optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
model, optimizer = dk.setup(model, optimizer)
# an EMA copy made after setup (on fsdp: sharded as the model), kept in sync and evaluated
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
ema = AveragedModel(dk.unwrap(model), multi_avg_fn=get_ema_multi_avg_fn(0.8))
dk.keep_in_sync(ema)
loader = dk.dataloader(cfg["train_dataset"](), batch_size=8, shuffle=True)
norms, ema_losses = [], []
for step, batch in zip(range(6), loader):
    dk.backward(model(**batch).loss)
    norms.append(float(dk.clip_grad_norm(0.5)))
    dk.step()
    ema.update_parameters(dk.unwrap(model))
    with torch.no_grad():
        ema_losses.append(float(dk.all_reduce(ema(**batch).loss.detach(), op="mean")))
dk.finish()
dk.save(args.out + "/ckpt", {"model": model, "optimizer": optimizer})
whole = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
ema_state = {n: whole(p.detach()).clone() for n, p in ema.module.named_parameters()}
summary = dk.summary(norms=norms, ema_losses=ema_losses)
if dk.is_main:
    json.dump(summary, open(args.out + "/summary.json", "w"))
    torch.save(ema_state, args.out + "/ema.pt")
'''


# (param: 4 ranks of GPT-2, twice; the fast tier has param mode's own case)
@pytest.mark.parametrize("mode", ["grad", pytest.param("param", marks=pytest.mark.full(
    tiers.MORE_RANKS))], ids=["fsdp-grad", "fsdp-param-2x2"])
def test_gpt2_in_an_own_loop_on_fsdp_gives_ddps_model(tmp_path: Path, mode: str) -> None:
    """The own-loop API with a real model (GPT-2 tiny, tied embeddings, dict batches): ``dk.setup``,
    ``dk.backward``, ``dk.clip_grad_norm`` (the global norm over the shards), ``dk.step``, ``dk.finish``,
    ``dk.save``, an EMA copy made after setup (``AveragedModel``, ``dk.keep_in_sync``, evaluated each step); the
    exported model is ddp's within 1e-6 (the clip's scale carries the norm's rounding; measured
    below), the tie kept."""
    from distkit.commands.export import main as export_main

    script = tmp_path / "own_loop.py"
    script.write_text(OWN_LOOP.replace("CONFIG", str(ROOT / "configs" / "gpt2_tiny.py")))
    # param: 2 replica groups of 2 ranks (fsdp shards inside a group; the EMA's shards averaged across them)
    dist = "'reduce_type': 'param', 'param_sync_step': 4, 'param_sync_group_size': 2" if mode == "param" else \
        "'reduce_type': 'grad'"
    nprocs = 4 if mode == "param" else 2
    got = {}
    for engine in ("ddp", "fsdp"):
        out = tmp_path / engine
        out.mkdir()
        ok(run([str(BIN / "python"), str(script), "--out", str(out), "--nprocs", str(nprocs), "++distributed",
                "{'backend': '" + engine + "', " + dist + "}", "++progress_bar", "False"]))
        assert export_main([str(out / "ckpt"), str(out / "model.pt")]) == 0
        got[engine] = (json.loads((out / "summary.json").read_text()), torch.load(out / "model.pt", weights_only=True))
    (s, model), (s_ddp, model_ddp) = got["fsdp"], got["ddp"]
    assert (s["backend"], s["reduce_type"], s["steps"], s["ranks_in_sync"]) == ("fsdp", mode, 6, True)
    # the norm sums the shards' squares in another order than ddp's one flat vector: rounding (measured: 1.2e-7
    # relative, the model 2.4e-8; param mode 0)
    assert len(s["norms"]) == 6 and min(s["norms"]) > 0.5  # each step clipped
    assert max(abs(a - b) / b for a, b in zip(s["norms"], s_ddp["norms"])) <= 1e-6, (s["norms"], s_ddp["norms"])
    assert model.keys() == model_ddp.keys() and max_abs_diff(model, model_ddp) <= 1e-6
    assert model["lm_head.weight"].equal(model["transformer.wte.weight"])
    # the EMA copy (AveragedModel after setup: sharded on fsdp, its forward gathering its units): ddp's, tie kept
    ema, ema_ddp = (torch.load(tmp_path / e / "ema.pt", weights_only=True) for e in ("fsdp", "ddp"))
    assert ema.keys() == ema_ddp.keys() and max_abs_diff(ema, ema_ddp) <= 1e-6
    assert "lm_head.weight" not in ema  # (tied: one parameter, under its first name)
    assert max(abs(a - b) for a, b in zip(s["ema_losses"], s_ddp["ema_losses"])) <= 1e-5, (s["ema_losses"],
                                                                                               s_ddp["ema_losses"])
    assert len(s["ema_losses"]) == 6


HSDP_WAIT = '''
import json, sys, time, torch, distkit
dk = distkit.init({"distributed": {"backend": "fsdp", "fsdp": {"shard_group_size": 2}}, "nprocs": 4,
                   "progress_bar": False})
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
model, opt = dk.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(3):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    if dk.rank == 2 and step > 0:
        time.sleep(DELAY)  # the one rank late: only its replica peer (rank 0) waits for it, in HSDP's all-reduce
    dk.backward(loss)
    dk.step()
json.dump({"rank": dk.rank, "comm_wait_s": dk.comm_wait_s}, open(sys.argv[1] + f"/wait-{dk.rank}.json", "w"))
dk.close()
'''


@pytest.mark.full("a run of 4 ranks (HSDP 2x2), started by the script's own nprocs key")
def test_hsdp_counts_the_wait_in_its_all_reduce_across_the_replicas(tmp_path: Path) -> None:
    """HSDP (2 groups of 2 ranks): FSDP2 all-reduces each reduce-scattered shard across the replicas with its own
    call; the time blocked there is waiting on a collective, not compute (``compute_fraction``). Rank 2 is 1.5 s
    late before each of two backwards: its replica peer, rank 0, waits for it in that all-reduce only (its own
    group's reduce-scatter and all-gathers are with rank 1, on time), so rank 0's ``comm_wait_s`` holds the 3 s,
    where before it held none of it (counted as compute)."""
    script = tmp_path / "hsdp_wait.py"
    script.write_text(HSDP_WAIT.replace("DELAY", "1.5"))
    ok(run([str(BIN / "python"), str(script), str(tmp_path)]))
    waits = {r: json.loads((tmp_path / f"wait-{r}.json").read_text())["comm_wait_s"] for r in range(4)}
    assert waits[0] >= 2.9, waits  # the two delays, less scheduling slack
    assert waits[2] < 2.9, waits  # the late rank itself waited for nobody that long


CONTAINERS = '''
import sys, torch, distkit
from torch import nn

class Net(nn.Module):  # blocks in a ModuleList, heads in a ModuleDict: direct children fully_shard refuses
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
        self.heads = nn.ModuleDict({"a": nn.Linear(8, 2), "b": nn.Linear(8, 1)})

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.heads["a"](h).sum(1) + self.heads["b"](h).squeeze(1)

dk = distkit.init({"nprocs": 2, "progress_bar": False}, distributed={"backend": sys.argv[2]})
torch.manual_seed(0)
model = Net()
model, opt = dk.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
for step in range(4):
    g = torch.Generator().manual_seed(10 * step + dk.rank)
    dk.backward(model(torch.randn(4, 6, generator=g)).pow(2).mean())
    dk.step()
full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in dk.unwrap(model).named_parameters()}
units = sum(1 for m in dk.unwrap(model).modules() if type(m).__name__.startswith("FSDP"))
if dk.is_main:
    torch.save({"params": full, "units": units}, sys.argv[1])
dk.close()
'''


def test_module_lists_and_dicts_are_cut_into_a_unit_per_element_and_train_as_ddp(tmp_path: Path) -> None:
    """Issue 57 I: a model whose direct children are an ``nn.ModuleList`` and an ``nn.ModuleDict`` (fully_shard
    refuses containers without a forward: a traceback before) gets a unit per element (3 blocks, 2 heads, the
    embedding, the root) and trains as ddp does (4 SGD steps with momentum)."""
    script = tmp_path / "containers.py"
    script.write_text(CONTAINERS)
    got = {}
    for engine in ("ddp", "fsdp"):
        ok(run([str(BIN / "python"), str(script), str(tmp_path / f"{engine}.pt"), engine], timeout=170))
        got[engine] = torch.load(tmp_path / f"{engine}.pt", weights_only=True)
    assert got["fsdp"]["units"] == 7 and got["ddp"]["units"] == 0
    assert got["fsdp"]["params"].keys() == got["ddp"]["params"].keys()
    assert max_abs_diff(got["fsdp"]["params"], got["ddp"]["params"]) <= 1e-6
