"""The engine-neutral ("portable") part of a checkpoint: any engine, any world size, any mode.

Every checkpoint directory holds, next to each rank's own file, ``portable/``: a
``torch.distributed.checkpoint`` (DCP) checkpoint of the training state keyed by *name*::

    model/<state_dict key>                    every tensor of the bare model (fp32 masters on DeepSpeed)
    optim/<parameter name>/<state key>        optimizer state by parameter name (exp_avg, step, ...)
    averager/anchor/<name>, .../momentum/<name>   param mode's outer optimizer (DiLoCo): the model as of
                                              the last sync and the outer momentum, by state_dict key
    meta                                      (object) optimizer param_groups by parameter name,
                                              progress (step, global samples, global batch), the
                                              user's other entries (scheduler state, epoch, ...)

Writing is sharded: the tensors are dealt out to the ranks by size (largest first, to the rank
with the fewest bytes so far; the same deal on every rank), each rank writes only its share
(``__<rank>_0.distcp``), and rank 0 writes DCP's ``.metadata``. No rank gathers what it does not
already hold: under ZeRO a parameter's full state is assembled one tensor at a time and kept only
by the rank that writes it. The DCP planning exchange runs over the engine's own object
collectives (:meth:`Strategy.all_gather_object`), so the mpi and Horovod engines need no torch
process group. Reading needs no process group (``no_dist``): every rank reads the whole state.

Contract: in grad mode every rank holds the same parameters and optimizer state, so any rank's share
is the truth; buffers (BatchNorm's running statistics) are each rank's own since its last forward, and
rank 0's are written, as a DDP script saves them. In param mode ranks differ between syncs; the
portable part holds rank 0's replica (parameters, buffers and optimizer state), which is what a
resume on another layout starts every rank from.
"""
from __future__ import annotations

import heapq
import os
import pickle
from typing import Any, Optional

import torch

from distkit.env import Collectives
from distkit.errors import CheckpointError

#: the portable part's directory inside a checkpoint directory
DIR = "portable"
#: the prefix of param mode's averager state (its counters are in ``meta["averager"]``)
AVERAGER = "averager"
#: the key of the one pickled object (optimizer groups, progress, the user's other entries)
META = "meta"


def deal(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """Which rank writes each key: largest first, to the rank with the fewest bytes so far.
    Deterministic (ties by key, then by rank), so every rank computes the same deal."""
    heap = [(0, r) for r in range(world_size)]
    owner = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        load, rank = heapq.heappop(heap)
        owner[key] = rank
        heapq.heappush(heap, (load + sizes[key], rank))
    return owner


#: (model state, optimizer state by name, param groups): the engine-neutral state of a model and its optimizer
#: (:meth:`distkit.backends.base.Strategy.portable_state`)
State = tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], list[dict[str, Any]]]


def optimizer_state_by_name(optimizer_state: dict[str, Any], group_names: list[list[str]]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """A torch optimizer ``state_dict()`` (state keyed by position) re-keyed by parameter name.

    ``group_names[g]`` lists the names of param group ``g``'s parameters in their order. Returns
    ``(state, groups)``: ``state[name][key]`` and the groups' hyper-parameters with ``params`` as names."""
    order = [n for names in group_names for n in names]
    state = {order[int(i)]: dict(s) for i, s in optimizer_state["state"].items()}
    groups = []
    for g, saved in enumerate(optimizer_state["param_groups"]):
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": list(group_names[g])})
    return state, groups


def optimizer_state_from_names(state: dict[str, dict[str, Any]], groups: list[dict[str, Any]],
                               group_names: list[list[str]]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_by_name` for an optimizer whose groups hold ``group_names``:
    a ``state_dict()`` its ``load_state_dict`` takes. Raises CheckpointError when the groups differ."""
    if [sorted(g["params"]) for g in groups] != [sorted(n) for n in group_names]:
        raise CheckpointError("the checkpoint's optimizer parameter groups do not match this optimizer's "
                              f"({[len(g['params']) for g in groups]} vs {[len(n) for n in group_names]} parameters "
                              "per group): resume with the same optimizer set-up, or load only the model weights")
    index = {n: i for i, n in enumerate(n for names in group_names for n in names)}
    return {"state": {index[n]: s for n, s in state.items() if n in index},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                              "params": [index[n] for n in names]} for g, names in zip(groups, group_names)]}


def flatten(model: dict[str, torch.Tensor], optim_state: dict[str, dict[str, Any]]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """The portable tensors (``model/...``, ``optim/<name>/<key>``) and the optimizer state values that
    are not tensors (kept in ``meta``)."""
    tensors = {f"model/{k}": v for k, v in model.items() if isinstance(v, torch.Tensor)}
    scalars: dict[str, dict[str, Any]] = {}
    for name, st in optim_state.items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{name}/{key}"] = value
            else:
                scalars.setdefault(name, {})[key] = value
    return tensors, scalars


class Job:
    """One rank's part of a portable save after planning: :meth:`write` writes this rank's file (no
    collective: it may run in a background thread); the coordinator's :meth:`finish` writes DCP's
    ``.metadata`` from every rank's write results."""

    def __init__(self, writer: Any, planner: Any, plan: Any, metadata: Any) -> None:
        self._writer, self._planner, self._plan, self._metadata = writer, planner, plan, metadata

    def write(self) -> Any:
        """This rank's data file; returns its write results, or the exception that stopped it (never raises,
        so every rank reaches the exchange of results)."""
        try:
            futures = self._writer.write_data(self._planner.finish_plan(self._plan), self._planner)
            futures.wait()
            return futures.value()
        except Exception as e:  # e.g. a full disk
            return e if isinstance(e, OSError) else RuntimeError(f"{type(e).__name__}: {e}")

    def finish(self, results: list[Any]) -> None:
        """Coordinator only, after every rank's :meth:`write` succeeded: DCP's ``.metadata``."""
        self._writer.finish(metadata=self._metadata, results=results)


def plan(strategy: Collectives, directory: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
         copy: bool = False) -> Job:
    """Collective: plan the portable part in ``directory``; returns this rank's :class:`Job`.

    ``tensors``: the portable tensors this rank writes, its share of :func:`deal` (the shares of all
    ranks together hold every key once); ``meta``: rank 0's picklable object; ``copy``: take CPU
    copies now (the job is written later, while training changes the originals). Only DCP's public
    planner and storage-writer interfaces are used; the plan exchange goes through the strategy's
    object collectives, so no torch process group is needed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    mine: dict[str, Any] = {k: v.detach().to("cpu", copy=copy) for k, v in tensors.items()}
    coordinator = strategy.rank == 0
    if coordinator:  # pickled here: DCP's traversal of nested containers drops empty dicts
        mine[META] = pickle.dumps(meta)
    os.makedirs(directory, exist_ok=True)
    writer = dcp.FileSystemWriter(directory, single_file_per_rank=True, sync_files=True)
    planner = DefaultSavePlanner(flatten_state_dict=False)
    planner.set_up_planner(state_dict=mine, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
    writer.set_up_storage_writer(coordinator, rank=strategy.rank, use_collectives=True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans = strategy.all_gather_object(local)
    metadata = None
    if coordinator:
        plans, metadata = planner.create_global_plan(plans)
        plans = writer.prepare_global_plan(plans)
    return Job(writer, planner, strategy.broadcast_object(plans if coordinator else None, 0)[strategy.rank], metadata)


def save(strategy: Collectives, directory: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Collective: :func:`plan`, write and finish in one call. A failed write raises on every rank (the
    results exchange carries it), so no rank waits alone; a failure of rank 0's ``.metadata`` raises on
    rank 0 only."""
    job = plan(strategy, directory, tensors, meta)
    results = strategy.all_gather_object(job.write())
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]
    if strategy.rank == 0:
        job.finish(results)


def exists(checkpoint_dir: str) -> bool:
    return os.path.isfile(os.path.join(checkpoint_dir, DIR, ".metadata"))


def read_meta(checkpoint_dir: str) -> dict[str, Any]:
    """Only the ``meta`` object of the portable part (reads no tensor data)."""
    return read(checkpoint_dir, keys=[META])[META]  # type: ignore[no-any-return]


def read(checkpoint_dir: str, keys: Optional[list[str]] = None) -> dict[str, Any]:
    """Every entry (or those in ``keys``) of checkpoint ``checkpoint_dir``'s portable part (not
    collective; no process group): ``model/...`` and ``optim/...`` tensors on the CPU and ``meta``."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.path.join(checkpoint_dir, DIR)
    if not exists(checkpoint_dir):
        raise CheckpointError(f"checkpoint '{checkpoint_dir}' has no portable part ({path}/.metadata): it was written "
                              "by an earlier distkit, before portable checkpoints, and resumes only with the engine, number of ranks and mode that "
                              "wrote it")
    reader = dcp.FileSystemReader(path)
    # the template DCP loads into, from its own metadata (tensors of the saved shape; objects replaced)
    out: dict[str, Any] = {k: torch.empty(v.size, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata)
                           else None for k, v in reader.read_metadata().state_dict_metadata.items()
                           if keys is None or k in keys}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=reader, planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)
    out[META] = pickle.loads(out[META])
    return out


def describe(checkpoint_dir: str) -> dict[str, tuple[list[int], str]]:
    """Shape and dtype of every portable tensor, from DCP's metadata alone (reads no tensor data)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(os.path.join(checkpoint_dir, DIR)).read_metadata()
    return {k: (list(v.size), str(v.properties.dtype).replace("torch.", "")) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def model_state(entries: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The bare model's ``state_dict`` from :func:`read`'s entries."""
    return {k[len("model/"):]: v for k, v in entries.items() if k.startswith("model/")}


def optimizer_state(entries: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``state[parameter name][key]`` from :func:`read`'s entries (tensors and the scalars in ``meta``)."""
    state: dict[str, dict[str, Any]] = {}
    for name, scalars in entries[META].get("optim_scalars", {}).items():
        state.setdefault(name, {}).update(scalars)
    for k, v in entries.items():
        if k.startswith("optim/"):
            name, key = k[len("optim/"):].rsplit("/", 1)
            state.setdefault(name, {})[key] = v
    return state


def averager_state(entries: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Param mode's averager tensors (``anchor/<name>``, ``momentum/<name>``) from :func:`read`'s entries."""
    prefix = AVERAGER + "/"
    return {k[len(prefix):]: v for k, v in entries.items() if k.startswith(prefix)}


def group_names(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Each of ``optimizer``'s param groups as ``module``'s parameter names."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def restore(module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], sd: dict[str, torch.Tensor],
            optim_state: dict[str, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """Load a plain (unsharded) ``module`` and ``optimizer`` from name-keyed state; the optimizer is left
    as it is when it is None or the checkpoint holds none (``groups`` empty)."""
    module.load_state_dict(sd)
    if optimizer is not None and groups:
        optimizer.load_state_dict(optimizer_state_from_names(optim_state, groups, group_names(module, optimizer)))


def load_into(checkpoint_dir: str, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, Any]:
    """Load a distkit checkpoint into a plain PyTorch ``model`` (and ``optimizer``) in one process, no
    engine and no process group needed; returns the checkpoint's ``meta`` (progress, other entries).
    The checkpoint's integrity is not checked here (``distkit inspect`` does)."""
    entries = read(checkpoint_dir)
    restore(model, optimizer, model_state(entries), optimizer_state(entries), entries[META]["optim_groups"])
    return entries[META]  # type: ignore[no-any-return]
