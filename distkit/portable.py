"""The engine-neutral ("portable") part of a checkpoint: any engine, any world size, any mode.

Every checkpoint directory holds, next to each rank's own file, ``portable/``: a
``torch.distributed.checkpoint`` (DCP) checkpoint of the training state keyed by *name*::

    model/<state_dict key>                    every tensor of the bare model (fp32 masters on DeepSpeed)
    optim/<parameter name>/<state key>        optimizer state by parameter name (exp_avg, step, ...)
    averager/anchor/<name>, .../momentum/<name>   param mode's outer optimizer (DiLoCo): the model as of
                                              the last sync and the outer momentum, by state_dict key
    meta                                      (bytes of torch.save) optimizer param_groups by parameter
                                              name, progress (step, global samples, global batch), the
                                              user's other entries (scheduler state, epoch, ...)

Writing is sharded: the tensors are dealt out to the ranks by size (largest first, to the rank
with the fewest bytes so far; the same deal on every rank), each rank writes only its share
(``__<rank>_0.distcp``), and rank 0 writes DCP's ``.metadata``. No rank gathers what it does not
already hold: under ZeRO a parameter's full state is assembled one tensor at a time and kept only
by the rank that writes it. The DCP planning exchange runs over the engine's own object
collectives (:meth:`Strategy.all_gather_object`), so the mpi and Horovod engines need no torch
process group. Reading needs no process group (``no_dist``): every rank reads the whole state.

Reading runs no code from the files (docs/security.md): a checkpoint may come from elsewhere. Every file distkit
reads that ``torch.save`` wrote goes through :func:`load_file` (torch's weights-only unpickler: tensors, containers,
numbers, strings, numpy arrays); DCP's ``.metadata`` (a plain pickle, read by torch with ``pickle.load``) through
:class:`_Unpickler`, which builds only DCP's own metadata classes; ``meta`` is written with ``torch.save`` and
read weights-only. Anything else stops the load with :class:`~distkit.errors.CheckpointError` naming the file, before
any of it runs.

Contract: in grad mode every rank holds the same parameters and optimizer state, so any rank's share
is the truth; buffers (BatchNorm's running statistics) are each rank's own since its last forward, and
rank 0's are written, as a DDP script saves them. In param mode ranks differ between syncs; the
portable part holds rank 0's replica (parameters, buffers and optimizer state), which is what a
resume on another layout starts every rank from.
"""
from __future__ import annotations

import heapq
import io
import os
import pickle
import re
from typing import Any, Optional

import torch

from distkit.env import Collectives
from distkit.errors import CheckpointError

#: the portable part's directory inside a checkpoint directory
DIR = "portable"
#: the prefix of param mode's averager state (its counters are in ``meta["averager"]``)
AVERAGER = "averager"
#: the key of the one object (optimizer groups, progress, the user's other entries), as the bytes of torch.save
META = "meta"


def _numpy_globals() -> list[Any]:
    """The globals a checkpoint file may name beyond torch's weights-only defaults: numpy's array and scalar
    reconstruction (``np.random.get_state()`` is an array of uint32; numpy scalars in a user's entries). They build
    arrays of the types the file states; an object array's items come through the same restricted unpickler."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2 / 1
    names = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype]
    names += [type(np.dtype(t)) for t in ("b", "u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f2", "f4", "f8", "c8",
                                          "c16", "?")]
    return names


def _refused(path: str, error: BaseException) -> CheckpointError:
    """The one line for a file the weights-only unpickler refused: the global it named, the file, the trust model."""
    text = str(error).strip()
    found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"Unsupported global: ([\w.]+)", text)
    what = found.group(1) if found else text.splitlines()[0][:200] if text else type(error).__name__
    return CheckpointError(f"{path}: refused: loading it would run code (it names {what}); distkit reads tensors, "
                           "numbers, strings, containers and numpy arrays only, so a checkpoint from elsewhere cannot run "
                           "code here (docs/security.md): re-save the object's state (state_dict(), plain values)")


def load_file(path: str, mmap: bool = False) -> Any:
    """The contents of a file ``torch.save`` wrote, on the CPU, read with torch's weights-only unpickler and
    :func:`_numpy_globals`: no code of the file runs. Raises :class:`CheckpointError` naming ``path`` for a file that
    names anything else (a pickled object's ``__reduce__``) or is not a torch file."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise _refused(path, e) from None
    except (RuntimeError, EOFError, ValueError) as e:  # not a torch file, truncated
        raise CheckpointError(f"{path}: not a readable torch file ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else 'empty'})") from None


#: what DeepSpeed's own checkpoint files name besides tensors and numpy (its ZeRO and bf16 optimizer states): the ZeRO
#: stage enum (built from its value), the loss scalers (state_dict stores the object; built from their attributes, no
#: __setstate__) and the fragment addresses of ZeRO-1/2's param_slice_mappings (a two-int dataclass): none runs code
#: of the file
DEEPSPEED_GLOBALS = frozenset({"deepspeed.runtime.zero.config.ZeroStageEnum",
                               "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                               "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                               "deepspeed.utils.tensor_fragment.fragment_address"})
_NUMPY_NAMES = re.compile(r"numpy(\._core|\.core)?\.(multiarray\._reconstruct|multiarray\.scalar|ndarray|dtype|dtypes\.\w+)")


def code_in(value: Any) -> list[str]:
    """The globals (``module.name``) a checkpoint file holding ``value`` would name that :func:`load_file` refuses:
    classes and functions whose loading runs code. Pickles ``value`` with its tensors as references (no tensor data
    is copied) and reads the names off the pickle; nothing is written."""
    import pickletools

    from torch import _weights_only_unpickler

    class _Refs(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Optional[str]:
            return "tensor" if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)) else None

    buf = io.BytesIO()
    try:
        _Refs(buf, protocol=2).dump(value)
    except Exception as e:  # noqa: BLE001 - cannot be pickled at all (a lambda, a lock): cannot be saved either
        return [f"{type(e).__name__}: {e}"]
    allowed = set(_weights_only_unpickler._get_allowed_globals())
    names = [str(arg).replace(" ", ".") for op, arg, _ in pickletools.genops(buf.getvalue()) if op.name == "GLOBAL"]
    return [n for n in dict.fromkeys(names) if n not in allowed and not _NUMPY_NAMES.fullmatch(n)]


def check_saveable(state: dict[str, Any], what: str = "state") -> None:
    """Raise :class:`~distkit.errors.UsageError` naming the first entry of ``state`` (a path such as
    ``state['sched']['fn']``) whose saving would need code to run at load (see :func:`code_in`)."""
    from distkit.errors import UsageError

    for key, value in state.items():
        names = code_in(value)
        if not names:
            continue
        where = f"{what}[{key!r}]"
        while isinstance(value, dict):  # down to the innermost entry that holds it
            inner = next(((k, v) for k, v in value.items() if code_in(v)), None)
            if inner is None:
                break
            where, value = f"{where}[{inner[0]!r}]", inner[1]
        raise UsageError(f"dk.save: {where} holds {names[0]}, which loading would have to import and run: distkit "
                         "checkpoints hold tensors, numbers, strings, lists, tuples, dicts and numpy arrays only, so a "
                         "checkpoint from elsewhere cannot run code (docs/security.md): save its state_dict() or plain "
                         "values")


def check_files(paths: list[str], allowed: frozenset[str] = frozenset()) -> None:
    """Refuse, before another library reads them with ``torch.load(weights_only=False)`` (DeepSpeed's
    ``load_checkpoint`` and ``zero_to_fp32`` do), files ``torch.save`` wrote that name any global beyond torch's
    weights-only set, numpy's and ``allowed`` (full names). Reads each file's pickle without running it."""
    for path in paths:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception as e:  # noqa: BLE001 - not a torch file: refused as one
            raise CheckpointError(f"{path}: not a readable torch file ({type(e).__name__}: {e})") from None
        bad = [n for n in names if n not in allowed and not _NUMPY_NAMES.fullmatch(n)]
        if bad:
            raise _refused(path, pickle.UnpicklingError(f"Unsupported global: {bad[0]}"))


def _loads(data: bytes, where: str) -> Any:
    """``meta``'s bytes: torch.save's (zip) read weights-only; a plain pickle (what distkit wrote before it used
    torch.save here) by :class:`_Unpickler` with plain containers only, never ``pickle.loads``."""
    try:
        if data[:2] == b"PK":
            with torch.serialization.safe_globals(_numpy_globals()):
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return _Unpickler(io.BytesIO(data), {("collections", "OrderedDict")}).load()
    except (pickle.UnpicklingError, AttributeError, TypeError, ValueError) as e:
        raise _refused(where, e) from None


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


#: DCP's metadata classes: what ``portable/.metadata`` may build (anything else is refused)
_DCP_METADATA = {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "MetadataIndex", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorStorageMetadata",
    "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("pathlib", "PosixPath"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


class _Unpickler(pickle.Unpickler):
    """A plain pickle's reader that builds only the classes in ``allowed`` ((module, name) pairs) and torch dtypes:
    nothing else is looked up, so nothing else can be called. DCP's ``.metadata`` is such a pickle, which torch
    reads with ``pickle.load`` (any class, any call)."""

    def __init__(self, file: Any, allowed: set[tuple[str, str]]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._allowed or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: {module}.{name}")


def _WeightsOnlyPlanner(path: str) -> Any:
    """DCP's ``DefaultLoadPlanner`` (no flattening), whose object entries are read weights-only: torch's own reads
    them with ``torch.load(weights_only=False)``, which runs what the file says."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _Planner(DefaultLoadPlanner):  # type: ignore[misc]
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            where = os.path.join(path, read_item.dest_index.fqn)
            try:
                with torch.serialization.safe_globals(_numpy_globals()):
                    self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise _refused(where, e) from None

    return _Planner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _reader(path: str) -> Any:
    """A DCP ``FileSystemReader`` of ``path`` whose metadata is read by :class:`_MetadataUnpickler`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(dcp.FileSystemReader):  # type: ignore[misc]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            where = os.path.join(path, ".metadata")
            try:
                with open(where, "rb") as f:
                    metadata = _Unpickler(f, _DCP_METADATA).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
                raise _refused(where, e) from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(path)


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
    if coordinator:  # serialised here: DCP's traversal of nested containers drops empty dicts
        mine[META] = _dumps(meta)
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
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.path.join(checkpoint_dir, DIR)
    if not exists(checkpoint_dir):
        raise CheckpointError(f"checkpoint '{checkpoint_dir}' has no portable part ({path}/.metadata): it was written "
                              "by an earlier distkit, before portable checkpoints, and resumes only with the engine, number of ranks and mode that "
                              "wrote it")
    reader = _reader(path)
    # the template DCP loads into, from its own metadata (tensors of the saved shape; objects replaced)
    out: dict[str, Any] = {k: torch.empty(v.size, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata)
                           else None for k, v in reader.read_metadata().state_dict_metadata.items()
                           if keys is None or k in keys}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": intended
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(out, storage_reader=reader, planner=_WeightsOnlyPlanner(path), no_dist=True)
        except CheckpointException as e:  # DCP wraps what a read raised: ours is the one line to show
            ours = [f[0] for f in e.failures.values() if isinstance(f[0], CheckpointError)]  # (exception, stack)
            if ours:
                raise ours[0] from None
            raise
    out[META] = _loads(out[META], os.path.join(path, "meta"))
    return out


def describe(checkpoint_dir: str) -> dict[str, tuple[list[int], str]]:
    """Shape and dtype of every portable tensor, from DCP's metadata alone (reads no tensor data)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = _reader(os.path.join(checkpoint_dir, DIR)).read_metadata()
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
