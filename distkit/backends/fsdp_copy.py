"""A copy of the sharded model on the fsdp engine: what ``copy.deepcopy(model)`` (and so an EMA's
``torch.optim.swa_utils.AveragedModel``) gives after ``dk.setup`` sharded it.

FSDP2's module classes refuse a deep copy, and a plain copy of the sharded module could not run: its parameters
are DTensors that a forward must gather first. So the copy is built the way the model was: a skeleton of the
model taken before ``fully_shard`` (every parameter and buffer on the meta device: no memory), materialised,
sharded on the same mesh into the same units with the same options, and each of its shards set from the
model's own shard (a local copy, no communication). The copy is an FSDP2 module of its own: its forward gathers
its units as the model's does (a collective: every rank of the mesh runs it, as an evaluation forward of the
model), and its parameters are DTensors of the same placements as the model's, so an EMA's in-place update
(``torch._foreach_lerp_`` of the copy's parameters towards the model's) works on the local shards, as the
optimizer's step does.

A copy of one unit (a submodule) is refused with the fix: only the whole model has a skeleton.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
from torch import nn

from distkit.errors import UsageError

from .parts import local


#: the attribute of a sharded root module that holds its copier (:func:`make_copier`)
COPIER = "_distkit_copier"


def skeleton(module: nn.Module) -> tuple[Optional[nn.Module], str]:
    """``module`` deep-copied with every parameter and buffer replaced by an empty meta tensor of its shape and
    dtype (tied parameters stay tied): the structure a copy is built from, taken before ``fully_shard``. (None,
    why) where the module cannot be deep-copied (an attribute that refuses it); the copy is refused then."""
    memo: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers()]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    try:
        return copy.deepcopy(module, memo), ""
    except Exception as e:  # (an attribute that refuses a copy: the model's own, said when a copy is asked for)
        return None, f"{type(e).__name__}: {e}"


def make_copier(device: torch.device, template: Optional[nn.Module], why: str,
                shard: Callable[[nn.Module], None]) -> Callable[[nn.Module, dict[int, Any]], nn.Module]:
    """The function that copies a sharded model: ``shard(module)`` shards a materialised skeleton into the units
    and mesh the model has (the engine's own ``fully_shard`` calls and collective hooks); ``device``: the engine's."""

    def copier(model: nn.Module, memo: dict[int, Any]) -> nn.Module:
        if template is None:
            raise UsageError(f"copy.deepcopy({type(model).__name__}) on backend 'fsdp': the model could not be copied "
                             f"before sharding ({why}): make that attribute copyable, or build the copy before dk.setup")
        new = materialised(copy.deepcopy(template), device)
        shard(new)
        with torch.no_grad():  # this rank's shards and its whole buffers, from the model's: no communication
            for a, b in zip(new.parameters(), model.parameters(), strict=True):
                local(a).copy_(local(b))
                a.requires_grad_(b.requires_grad)
            for a, b in zip(new.buffers(), model.buffers(), strict=True):
                a.copy_(b)
        new.train(model.training)
        memo[id(model)] = new
        return new

    return copier


def materialised(module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` with each meta parameter and buffer replaced by an uninitialised tensor on ``device``, in place;
    a tensor registered twice (tied weights) stays one (``nn.Module.to_empty`` would untie them)."""
    made: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for key, t in table.items():
                if t is None:
                    continue
                if id(t) not in made:
                    empty = torch.empty_like(t, device=device)
                    made[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                        else empty
                table[key] = made[id(t)]  # type: ignore[assignment]
    return module


def deep_copy(self: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``__deepcopy__`` of FSDP2's module classes: the whole sharded model through its copier; a unit refused."""
    copier = self.__dict__.get(COPIER)
    if copier is None:
        raise UsageError(f"copy.deepcopy({type(self).__name__}): backend 'fsdp' sharded this module as a part of the "
                         "model: copy the whole model (dk.unwrap(model)), or build the copy before dk.setup")
    return copier(self, memo)
