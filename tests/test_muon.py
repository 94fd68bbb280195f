"""Muon as the inner optimizer (issue 60 item 5, MuLoCo): ``optimizer = {"class": "muon", ...}`` builds one
:class:`distkit.components.MuonWithAdamW`, torch.optim.Muon on the 2-D hidden matrices and torch.optim.AdamW on the
rest (vectors, embeddings, the output head). Closed forms: its step is torch's two optimizers' steps, bit for bit,
on the same split; Muon's update of a known matrix is orthogonal to within Newton-Schulz's band; its state round-trips
through ``state_dict``. Real 2-rank runs: mpi, Horovod and FSDP2 (whole matrices gathered for the orthogonalisation)
end with DDP's model in grad and param mode (DiLoCo's outer optimizer), DeepSpeed ZeRO 0 in grad mode; a run killed
and resumed from a checkpoint ends as the uninterrupted one (DDP; Horovod, whose DistributedOptimizer is rebuilt
from the param groups and broadcasts the loaded state); what cannot work is one line and exit status 2."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import distkit, final_params, max_abs_diff, ok, summary
from distkit.components import MuonWithAdamW, build_optimizer, split_for_muon
from distkit.config import RunConfig


class _Tiny(nn.Module):
    """An embedding, two hidden matrices with biases, an output head: Muon gets ``body.*.weight`` only."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randint(0, 11, (6,), generator=g), torch.randint(0, 5, (6,), generator=g)
    return nn.functional.cross_entropy(model(x), y)


def _muon(model: nn.Module, **spec: object) -> torch.optim.Optimizer:
    cfg = RunConfig(optimizer={"class": "Muon", **spec}, learning_rate=0.02)
    return build_optimizer(cfg, model.parameters(), 1, model.named_parameters)


def test_the_split_and_the_defaults() -> None:
    model = _Tiny()
    opt = _muon(model)
    assert isinstance(opt, MuonWithAdamW) and [g["use_muon"] for g in opt.param_groups] == [True, False]
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for p in opt.param_groups[0]["params"]] == ["body.0.weight", "body.2.weight"]
    assert [names[id(p)] for p in opt.param_groups[1]["params"]] == [
        "embed.weight", "body.0.bias", "body.2.bias", "head.weight", "head.bias"]
    muon, adamw = opt.param_groups
    assert (muon["lr"], muon["adjust_lr_fn"], muon["weight_decay"]) == (0.02, "match_rms_adamw", 0.1)
    assert (adamw["lr"], adamw["weight_decay"], adamw["betas"]) == (0.02, 0.1, (0.9, 0.999))  # Muon's lr and decay
    # adamw_names replaces the default list; [] sends every 2-D parameter to Muon
    everything = split_for_muon(model.parameters(), names, [])[0]
    assert [names[id(p)] for p in everything] == ["embed.weight", "body.0.weight", "body.2.weight", "head.weight"]
    opt = _muon(model, adamw={"lr": 3e-4, "betas": (0.9, 0.95)}, adamw_names=["^body\\.2"], momentum=0.9)
    assert [names[id(p)] for p in opt.param_groups[0]["params"]] == ["embed.weight", "body.0.weight", "head.weight"]
    assert (opt.param_groups[0]["momentum"], opt.param_groups[1]["lr"], opt.param_groups[1]["betas"]) == (
        0.9, 3e-4, (0.9, 0.95))


def test_its_steps_are_torchs_muon_and_adamw_steps() -> None:
    torch.manual_seed(0)
    model = _Tiny()
    twin = copy.deepcopy(model)
    opt = _muon(model, adamw={"betas": (0.9, 0.95)}, weight_decay=0.05)
    hidden = [twin.body[0].weight, twin.body[2].weight]
    rest = [twin.embed.weight, twin.body[0].bias, twin.body[2].bias, twin.head.weight, twin.head.bias]
    muon = torch.optim.Muon(hidden, lr=0.02, weight_decay=0.05, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=0.02, weight_decay=0.05, betas=(0.9, 0.95))
    for step in range(3):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
        _loss(twin, step).backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name


def test_one_muon_step_on_a_known_matrix_is_orthogonal() -> None:
    # one step from zero momentum, no decay: W -= lr * 0.2 * sqrt(max(rows, cols)) * NS(G), NS(G) ~ U V^T
    w = nn.Parameter(torch.zeros(4, 6))
    g = torch.zeros(4, 6)
    g[0, 0], g[1, 1], g[2, 2], g[3, 5] = 4.0, 1.0, 0.25, -2.0  # singular values 4, 2, 1, 0.25; U V^T known
    opt = MuonWithAdamW([{**torch.optim.Muon([w], lr=0.1, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
                          .param_groups[0], "use_muon": True}])
    w.grad = g.clone()
    opt.step()
    update = -w.detach() / (0.1 * 0.2 * 6 ** 0.5)
    sv = torch.linalg.svdvals(update)
    assert sv.min() > 0.6 and sv.max() < 1.25, sv  # Newton-Schulz's quintic: near 1, not exactly 1
    assert torch.allclose(update, torch.sign(g), atol=0.4)  # U V^T of this G is its sign pattern
    assert torch.equal(opt.state[w]["momentum_buffer"], 0.05 * g)  # lerp from 0 by 1 - momentum


def test_state_dict_round_trip_and_a_scheduler_scales_both_parts() -> None:
    torch.manual_seed(1)
    model = _Tiny()
    opt = _muon(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    for step in range(2):
        _loss(model, step).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert [g["lr"] for g in opt.param_groups] == [0.005, 0.005]
    twin = copy.deepcopy(model)
    again = _muon(twin)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))  # new group dicts: the parts are pointed at them
    assert [g["use_muon"] for g in again.param_groups] == [True, False]
    for m, o in ((model, opt), (twin, again)):
        _loss(m, 9).backward()
        o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="use_muon"):
        MuonWithAdamW([{"params": [nn.Parameter(torch.zeros(2, 2))]}])


# -- real runs -----------------------------------------------------------------------------------------------------
PARAM = ", 'reduce_type': 'param', 'param_sync_step': 4, 'outer_optimizer': {'class': 'nesterov', 'lr': 0.7, " \
        "'momentum': 0.9}"
ENGINES = {"ddp": "'backend': 'ddp'", "mpi": "'backend': 'mpi'",
           "horovod": "'backend': 'horovod', 'require_horovod': True", "fsdp": "'backend': 'fsdp'",
           "zero0": "'backend': 'deepspeed', 'deepspeed_config': {'zero_optimization': {'stage': 0}}"}
COMMON = ["++max_steps", "12", "++progress_bar", "False", "++log_every", "4", "++checkpoint_every", "8",
          "++learning_rate", "0.01", "++optimizer", "{'class': 'muon', 'adamw': {'betas': (0.9, 0.95)}}"]


def _args(out: Path, engine: str, mode: str) -> list[str]:
    return ["train", "configs/returnn_ddp.py", "--nprocs", "2", "++output_dir", str(out), *COMMON,
            "++distributed", "{" + ENGINES[engine] + (PARAM if mode == "param" else "") + "}"]


def _train(out: Path, engine: str, mode: str) -> Path:
    ok(distkit(*_args(out, engine, mode), timeout=300))
    return out


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """DDP's runs, grad and param mode: the reference every engine's must equal."""
    base = tmp_path_factory.mktemp("muon")
    return {mode: _train(base / f"ddp-{mode}", "ddp", mode) for mode in ("grad", "param")}


@pytest.mark.parametrize("engine,mode", [("mpi", "grad"), ("mpi", "param"), ("horovod", "grad"), ("horovod", "param"),
                                         ("fsdp", "grad"), ("fsdp", "param"), ("zero0", "grad")])
def test_every_engine_ends_with_ddps_model(ddp_runs: dict[str, Path], engine: str, mode: str, tmp_path: Path) -> None:
    out = _train(tmp_path / "run", engine, mode)
    s = summary(out)
    assert s["ranks_in_sync"] is True and s["reduce_type"] == mode
    assert max_abs_diff(final_params(out), final_params(ddp_runs[mode])) == 0.0  # bit-identical on this machine
    assert max_abs_diff(final_params(out, 0), final_params(out, 1)) == 0.0


@pytest.mark.parametrize("engine", ["ddp", "horovod"])
def test_a_killed_run_resumes_as_the_uninterrupted_one(ddp_runs: dict[str, Path], engine: str,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "killed"
    killed = distkit(*_args(out, engine, "grad"), DISTKIT_FAULT="1:10:kill", timeout=300)
    said = f"exit {killed.returncode}\n{killed.stderr[-3000:]}"
    assert killed.returncode != 0 and "rank 1 failed (killed by SIGKILL)" in killed.stderr, said
    assert (out / "checkpoints" / "latest").read_text() == "step-0000008", said
    ok(distkit(*_args(out, engine, "grad"), "++resume", "auto", timeout=300))
    assert max_abs_diff(final_params(out), final_params(ddp_runs["grad"])) == 0.0


REFUSED = {
    "zero2": (["++distributed", "{'backend': 'deepspeed', 'deepspeed_config': {'zero_optimization': {'stage': 2}}}"],
              "DeepSpeed ZeRO stage 2 flattens into partitions: use backend 'ddp', 'mpi', 'horovod' or 'fsdp'"),
    "zero0_bf16": (["++precision", "bf16-mixed", "++distributed", "{'backend': 'deepspeed'}"],
                   "DeepSpeed precision 'bf16-mixed' flattens"),
    "adamw_not_a_dict": (["++optimizer", "{'class': 'muon', 'adamw': 3}"], "'adamw' must be a dict"),
    "unknown_key": (["++optimizer", "{'class': 'muon', 'ns_stepz': 3}"], "unexpected keyword argument 'ns_stepz'"),
    "bad_adamw_value": (["++optimizer", "{'class': 'muon', 'adamw': {'eps': -1.0}}"], "torch.optim.AdamW rejected"),
    "bad_regex": (["++optimizer", "{'class': 'muon', 'adamw_names': ['(']}"], "is not a regular expression"),
    "lr_in_the_dict": (["++optimizer", "{'class': 'muon', 'lr': 0.1}"], "remove 'lr' from the optimizer dict"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_cannot_work_is_one_line_and_exit_2(case: str, tmp_path: Path) -> None:
    extra, phrase = REFUSED[case]
    optimizer = [] if "++optimizer" in extra else ["++optimizer", "{'class': 'muon'}"]
    res = distkit("train", "configs/returnn_ddp.py", "--nprocs", "2", "++output_dir", str(tmp_path / "out"),
                  *optimizer, *extra)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distkit: error: ") and phrase in lines[0], res.stderr
    assert not (tmp_path / "out").exists()
