"""One FSDP2 step against a one-process full-batch reference (issue 38 item 9).

Every rank takes its equal slice of one global batch, runs forward, ``dk.backward``, ``dk.clip_grad_norm`` (with
a bound it does not reach) and ``dk.step``; rank 0 records the whole gradients (``full_tensor()``), the norm and the
parameters after the step into ``--out``. ``tests/test_fsdp_backend.py`` computes the same step in one process on
the whole batch: the mean gradient over N slices of equal size is the whole batch's. A torch whose gloo AVG sums
instead of averaging (pytorch/pytorch#162338) gives gradients N times too large, and fails the test.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

GLOBAL_BATCH = 12
LR = 0.1


def model() -> nn.Module:
    """Three Linear layers (three FSDP2 units by default) with odd sizes (uneven shards on 2 and 4 ranks)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 15), nn.Tanh(), nn.Linear(15, 13), nn.Tanh(), nn.Linear(13, 3))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)


def reference() -> dict[str, Any]:
    """The same step in one process on the whole batch, without distkit."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    x, y = data()
    nn.functional.cross_entropy(m(x), y).backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}  # type: ignore[union-attr]
    norm = float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9))
    opt.step()
    return {"grads": grads, "norm": norm, "params": {n: p.detach().clone() for n, p in m.named_parameters()}}


def main() -> None:
    import distkit

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    distkit.add_arguments(parser)
    args = parser.parse_args()
    dk = distkit.init(args)
    m, opt = dk.setup(model(), lambda params: torch.optim.SGD(params, lr=LR))
    x, y = data()
    per = GLOBAL_BATCH // dk.world_size
    mine = slice(dk.rank * per, (dk.rank + 1) * per)
    dk.backward(nn.functional.cross_entropy(m(x[mine]), y[mine]))
    bare = dk.unwrap(m)

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]

    grads = {n: whole(p.grad).clone() for n, p in bare.named_parameters()}  # type: ignore[arg-type]
    sharded = {n: type(p).__name__ for n, p in bare.named_parameters()}
    mesh = list(next(bare.parameters()).device_mesh.shape)  # type: ignore[attr-defined]
    norm = dk.clip_grad_norm(1e9)
    dk.step()
    params = {n: whole(p.detach()).clone() for n, p in bare.named_parameters()}
    summary = dk.summary()
    if dk.rank == 0:
        torch.save({"grads": grads, "norm": norm, "params": params, "world_size": dk.world_size, "kinds": sharded,
                    "mesh": mesh, "summary": summary}, args.out)
    dk.close()


if __name__ == "__main__":
    main()
