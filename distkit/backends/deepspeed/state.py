"""Model and optimizer state under DeepSpeed: gathering ZeRO-3 parameters, the fp32 masters and
optimizer state of each partition (portable checkpoints, param mode), and the engine's own checkpoint
files inside a distkit checkpoint directory."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from distkit import portable
from distkit.errors import ConfigError, UnsupportedCombination

from .config import ENGINE_DIR, TAG, _DeepSpeedConfigured
from .groups import _MasterAverager

if TYPE_CHECKING:
    from distkit import portable

    from .groups import _ReplicaGroups


@contextlib.contextmanager
def _writes_deferred(engine: Any) -> Iterator[list[Exception]]:
    """Inside the block, an error of DeepSpeed's file writes during ``save_checkpoint`` (its checkpoint
    engine's ``save``, rank 0's copy of the recovery script: a full disk, ENOSPC) is recorded in the list
    and the write returns, instead of raising out of the middle of ``save_checkpoint``: a rank that left
    there skipped the ``dist.barrier()`` at its end, and its next collective met the other ranks' barrier,
    so every rank waited for ``distributed.timeout_s`` (300 s) and then failed with a traceback. The caller
    raises the first one after ``save_checkpoint`` returned; distkit's checkpoint writer then has every rank
    agree on it (one line, exit 2, the previous checkpoint intact). Not collective by itself."""
    failures: list[Exception] = []

    def deferred(write: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if failures:  # the checkpoint is lost already: write nothing more
                return None
            try:
                return write(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - OSError, or torch.save's RuntimeError ("file write failed")
                if getattr(e, "filename", None) is None:  # (torch.save's says no file: the engine's path argument)
                    e.filename = next((a for a in args[::-1] if isinstance(a, str)), None)  # type: ignore[attr-defined]
                failures.append(e)
                return None
        return call

    patched = [(obj, name, vars(obj).get(name)) for obj, name in ((engine.checkpoint_engine, "save"),
                                                                   (engine, "_copy_recovery_script"))]
    for obj, name, _ in patched:
        setattr(obj, name, deferred(getattr(obj, name)))
    try:
        yield failures
    finally:
        for obj, name, own in patched:  # as before: the object's own attribute, or the class's method
            if own is not None:
                setattr(obj, name, own)
            else:
                delattr(obj, name)


class _DeepSpeedState(_DeepSpeedConfigured):
    """The base of :class:`~distkit.backends.deepspeed.engine.DeepSpeedStrategy` holding its state
    methods (the attributes below are set by its ``init``)."""

    zero_stage: int
    mpu: Optional[_ReplicaGroups]

    # -- state ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _gathered(self, module: nn.Module) -> Iterator[None]:
        """Collective under ZeRO-3 (inside the replica group): whole parameters for the duration."""
        if self.zero_stage == 3:
            import deepspeed  # type: ignore[import-untyped]

            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                yield
        else:
            yield

    @contextlib.contextmanager
    def _gathered_one(self, param: nn.Parameter) -> Iterator[None]:
        """Collective under ZeRO-3: one whole parameter for the duration."""
        if hasattr(param, "ds_id"):
            import deepspeed  # type: ignore[import-untyped]

            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                yield
        else:
            yield

    def full_named_parameters(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        module = self.unwrap(model)
        with self._gathered(module):
            named = [(n, p.detach().clone()) for n, p in module.named_parameters()]
        yield from named

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Param mode only (the replica groups differ between syncs): this group's whole model in fp32
        (collective inside the group under ZeRO-3) for the rank file; the resumable state is the engine
        checkpoint written by :meth:`save_engine_files`. Grad mode writes no such copy."""
        module = self.unwrap(model)
        with self._gathered(module):
            sd = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).clone()
                  for k, v in module.state_dict().items()}
        return {"model": sd, "optimizer": None, "zero_stage": self.zero_stage}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Nothing: :meth:`load_engine_files` restored model, optimizer and scheduler."""

    def _masters(self, engine: Any) -> tuple[list[torch.Tensor], Any]:
        """The optimizer's fp32 master tensors (this rank's partitions) and how to rewrite the weights from them."""
        opt = engine.optimizer
        if hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO-1/2
            return list(opt.single_partition_of_fp32_groups), opt.update_lp_params
        if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3
            def refresh() -> None:
                for i in range(len(opt.fp32_partitioned_groups_flat)):
                    opt._reassign_or_swap_out_partitioned_parameters(i)
            return list(opt.fp32_partitioned_groups_flat), refresh
        if hasattr(opt, "fp32_groups_flat_partition"):  # bf16 optimizer (stage 0 + bf16)
            return list(opt.fp32_groups_flat_partition), opt.update_lp_params
        params = list(engine.module.parameters())
        if any(p.dtype != torch.float32 for p in params):
            raise UnsupportedCombination(f"param mode cannot find the master weights of {type(opt).__name__}: "
                                         "use a ZeRO stage >= 1 or fp32")
        return params, lambda: None

    def _master_views(self, engine: Any) -> list[torch.Tensor]:
        """Per model parameter (``named_parameters`` order), the part of the fp32 master this rank holds, as a
        view into the optimizer's flat partition (writing it writes the master), or an empty tensor where this
        rank holds none of it (a frozen parameter, or one in another rank's ZeRO partition): what
        ``param_sync_fragments`` cuts by parameter, as on every other engine."""
        opt = engine.optimizer
        views: list[torch.Tensor] = []
        for p in self.unwrap(engine).parameters():
            if hasattr(opt, "fp32_partitioned_groups_flat") and hasattr(p, "ds_id"):  # ZeRO-3
                if not p.requires_grad:
                    views.append(torch.empty(0))
                    continue
                group, offset, numel = opt.grad_position[opt.get_param_id(p)]
                views.append(opt.fp32_partitioned_groups_flat[group].narrow(0, offset, numel))
            elif hasattr(p, "_hp_mapping"):  # ZeRO-1/2, bf16 optimizer
                views.append(p._hp_mapping.hp_fragment if p._hp_mapping is not None else torch.empty(0))
            elif p.dtype == torch.float32 and not hasattr(opt, "fp32_groups_flat_partition"):  # stage 0, fp32
                views.append(p)
            else:
                raise UnsupportedCombination(f"param_sync_fragments cannot find the master weights of "
                                             f"{type(opt).__name__}: use a ZeRO stage >= 1 or fp32")
        return views

    def _zero_groups(self, engine: Any) -> Optional[list[list[nn.Parameter]]]:
        """The model parameters of each optimizer group when ZeRO (1-3) or the bf16 optimizer partitions
        the fp32 state (None: the optimizer holds the model's own parameters)."""
        opt = engine.optimizer
        for attr in ("bit16_groups", "fp16_groups"):  # ZeRO-1/2 and bf16; ZeRO-3
            groups = getattr(opt, attr, None)
            if groups and any(hasattr(p, "_hp_mapping") or hasattr(p, "ds_id") for g in groups for p in g):
                return [list(g) for g in groups]
        return None

    @staticmethod
    def _flat(opt: Any, g: int) -> tuple[torch.Tensor, dict[str, Any], dict[str, Any]]:
        """Partitioned group ``g``'s fp32 flat tensor (this rank's partition), its state in the inner
        optimizer and the inner param group holding its hyper-parameters. (ZeRO-3 detaches the flats
        from the inner optimizer's param groups between steps, so they are found by attribute.)"""
        inner = opt.optimizer
        if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3 (sub-groups)
            flat = opt.fp32_partitioned_groups_flat[g]
            group = inner.param_groups[opt.sub_group_to_group_id[g]]
        else:
            flat = (opt.single_partition_of_fp32_groups if hasattr(opt, "single_partition_of_fp32_groups")
                    else opt.fp32_groups_flat_partition)[g]
            group = inner.param_groups[g]
        return flat, inner.state.setdefault(flat, {}), group

    @staticmethod
    def _link_optimizer_state(opt: Any) -> None:
        """Point every parameter's fragment mapping (ZeRO-1/2, bf16) at the inner optimizer's current state.

        DeepSpeed links them only once, lazily, after the step of the *first* param group: ZeRO-1/2 step
        the groups one at a time, so a second group (AdamW's no-decay group) is linked while its state is
        still empty and ``safe_get_full_optimizer_state`` then finds no ``exp_avg`` in it. Loading an
        engine checkpoint also rebuilds the mappings without their state (the flag stays set). Linking
        again only takes views (``narrow``) of the state tensors, so it is cheap and safe at any time.
        ZeRO-3 keeps no such link (it has no ``_hp_optimizer_states_linked``)."""
        if hasattr(opt, "_hp_optimizer_states_linked"):
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()

    def portable_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                       keep: Callable[[str], bool]) -> portable.State:
        """Under ZeRO each parameter's fp32 master and optimizer state are assembled one tensor at a
        time (a collective per tensor, every rank in the same order) and kept only where ``keep``
        says so; without partitioning the engine's optimizer is a plain one (the default)."""
        engine: Any = model
        groups = self._zero_groups(engine)
        if groups is None:
            return super().portable_state(self.unwrap(engine), engine.optimizer, keep)
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # type: ignore[import-untyped]

        module, opt = self.unwrap(engine), engine.optimizer
        self._link_optimizer_state(opt)  # DeepSpeed's own link may predate a group's state (see there)
        names = {id(p): n for n, p in module.named_parameters()}
        aliases: dict[int, list[str]] = {}  # every state_dict name of each parameter (tied weights have several)
        for key, value in module.state_dict(keep_vars=True).items():
            aliases.setdefault(id(value), []).append(key)
        sd: dict[str, torch.Tensor] = {}
        state: dict[str, dict[str, Any]] = {}
        out_groups = []
        for g, params in enumerate(groups):
            flat, base, inner_group = self._flat(opt, g)
            per_param = sorted(k for k, v in base.items() if torch.is_tensor(v) and v.numel() == flat.numel() and v.numel() > 1)
            for p in params:
                name = names[id(p)]
                full = safe_get_full_fp32_param(p)  # collective
                shape = tuple(getattr(p, "ds_shape", p.shape))
                for alias in aliases.get(id(p), [name]):
                    if keep(alias):
                        sd[alias] = full.detach().cpu().reshape(shape).clone()
                for key in per_param:
                    value = safe_get_full_optimizer_state(p, key)  # collective
                    if keep(name):
                        state.setdefault(name, {})[key] = value.detach().cpu().reshape(shape).clone()
                if keep(name):  # the group's scalars (Adam's step): one per flat group, the same for its parameters
                    for key, v in base.items():
                        if key not in per_param:
                            state.setdefault(name, {})[key] = v.detach().cpu().clone() if torch.is_tensor(v) else v
            hyper = {k: v for k, v in inner_group.items() if k != "params"}
            out_groups.append({**hyper, "params": [names[id(p)] for p in params]})
        in_groups = {id(p) for params in groups for p in params}
        for p in module.parameters():  # frozen parameters: in no optimizer group (partitioned under ZeRO-3)
            if id(p) not in in_groups:
                with self._gathered_one(p):
                    for alias in aliases.get(id(p), [names[id(p)]]):
                        if keep(alias):
                            sd[alias] = p.detach().to("cpu", torch.float32).clone()
        for key, value in module.state_dict(keep_vars=True).items():  # buffers (not partitioned)
            if id(value) not in names and keep(key):
                sd[key] = value.detach().cpu().clone()
        return sd, state, out_groups

    def load_portable_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                            sd: dict[str, torch.Tensor], optim_state: dict[str, dict[str, Any]],
                            groups: list[dict[str, Any]]) -> None:
        """Write the fp32 masters and optimizer state of every parameter into this rank's partitions
        (``safe_set_full_*``), then rebuild the 16-bit/partitioned weights from the masters."""
        engine: Any = model
        zgroups = self._zero_groups(engine)
        if zgroups is None:
            super().load_portable_state(self.unwrap(engine), engine.optimizer, sd, optim_state, groups)
            return
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state  # type: ignore[import-untyped]

        from distkit.portable import optimizer_state_from_names

        module, opt = self.unwrap(engine), engine.optimizer
        names = {id(p): n for n, p in module.named_parameters()}
        group_names = [[names[id(p)] for p in g] for g in zgroups]
        optimizer_state_from_names(optim_state, groups, group_names)  # the same groups, or a clear error
        with torch.no_grad():
            for g, params in enumerate(zgroups):
                flat, base, inner_group = self._flat(opt, g)
                first = optim_state.get(group_names[g][0], {}) if group_names[g] else {}
                shape = tuple(sd[group_names[g][0]].shape) if group_names[g] else ()
                per_param = [k for k, v in first.items() if torch.is_tensor(v) and k != "step" and tuple(v.shape) == shape]
                if first and not base:  # a fresh engine: the inner optimizer creates its state at the first step
                    for key, v in first.items():
                        base[key] = torch.zeros_like(flat) if key in per_param else (v.clone() if torch.is_tensor(v) else v)
                    self._link_optimizer_state(opt)  # ZeRO-1/2, bf16: link the new state to the parameters
                for p in params:
                    name = names[id(p)]
                    safe_set_full_fp32_param(p, sd[name].to(self.device))
                    for key in per_param:
                        if key in optim_state.get(name, {}):
                            safe_set_full_optimizer_state(p, optim_state[name][key].to(self.device), key)
                for key, v in first.items():  # the group's scalars
                    if key not in per_param and key in base:
                        base[key] = v.clone() if torch.is_tensor(v) else v
                saved = next(x for x in groups if sorted(x["params"]) == sorted(group_names[g]))
                inner_group.update({k: v for k, v in saved.items() if k != "params"})
            _, refresh = self._masters(engine)
            refresh()  # the model's weights from the masters just written
            in_groups = {id(p) for params in zgroups for p in params}
            for p in module.parameters():  # frozen parameters: no master, set directly (whole under ZeRO-3)
                if id(p) not in in_groups and names[id(p)] in sd:
                    if hasattr(p, "ds_id"):
                        import deepspeed  # type: ignore[import-untyped]

                        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                            if self.rank == 0:
                                p.data.copy_(sd[names[id(p)]].to(p.device, p.dtype))
                    else:
                        p.data.copy_(sd[names[id(p)]].to(p.device, p.dtype))
            params = set(names.values())
            for name, b in module.named_buffers():
                if name in sd and name not in params:
                    b.copy_(sd[name].to(b.device, b.dtype))

    def _engine_dir(self, directory: str) -> str:
        sub = f"group-{self.mpu.index}" if self.mpu is not None else "all"
        return os.path.join(directory, ENGINE_DIR, sub)

    engine_files = True

    def save_engine_files(self, directory: str, model: nn.Module) -> None:
        """Collective: ``engine.save_checkpoint`` into distkit's temporary checkpoint directory, without
        DeepSpeed's ``latest`` file (distkit's manifest + ``latest`` are what a resume trusts)."""
        if model is None:  # dk.save before dk.setup: no engine yet
            return
        path = self._engine_dir(directory)
        os.makedirs(os.path.join(path, TAG), exist_ok=True)  # DeepSpeed creates it on global rank 0 only
        engine: Any = model
        with _writes_deferred(engine) as failures:
            engine.save_checkpoint(path, tag=TAG, client_state={}, save_latest=False)
        if failures:
            raise failures[0]

    def load_engine_files(self, directory: str, model: nn.Module) -> None:
        path = self._engine_dir(directory)
        if not os.path.isdir(os.path.join(path, TAG)):
            raise ConfigError(f"checkpoint '{directory}' holds no DeepSpeed engine state ({path}): it was not written "
                              "by the deepspeed backend with this param_sync_group_size")
        # DeepSpeed reads its files with torch.load(weights_only=False): checked first (a checkpoint from
        # elsewhere runs no code here)
        tag = os.path.join(path, TAG)
        portable.check_files([os.path.join(tag, f) for f in sorted(os.listdir(tag)) if f.endswith(".pt")],
                             portable.DEEPSPEED_GLOBALS)
        engine: Any = model
        loaded, _ = engine.load_checkpoint(path, tag=TAG, load_module_strict=True, load_optimizer_states=True,
                                           load_lr_scheduler_states=True)
        if loaded is None:
            raise ConfigError(f"DeepSpeed could not load its checkpoint from {path}")


class _ViewAverager(_MasterAverager):
    """The master averager whose tensors are :meth:`_DeepSpeedState._master_views` (one per model parameter, in the
    model's order) rather than the optimizer's flat partitions ``flats`` (None: the flat partitions are its tensors):
    what it uses with a codec or fragments. Its rank-file state (anchor, error feedback, outer momentum, exchanges in
    flight) is then per parameter, as on every other engine; :meth:`load_state_dict` also takes the state of a
    checkpoint written before, per flat partition (a compressed run's), and cuts it into the views."""

    def __init__(self, flats: Optional[list[torch.Tensor]], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._flats = flats

    def load_state_dict(self, state: dict[str, Any]) -> None:
        where = self._flat_to_views(state)
        super().load_state_dict(state if where is None else self._cut_state(state, where))

    def _flat_to_views(self, state: dict[str, Any]) -> Optional[list[Optional[tuple[int, int]]]]:
        """Where the state's per-tensor lists are per flat partition (the layout before views): per view, the flat
        partition it lies in and its offset there (None: an empty view); else None (nothing to cut)."""
        saved = state.get("anchor") or state.get("error")
        if not self._flats or not saved or [t.numel() for t in saved] == [t.numel() for t in self.tensors]:
            return None
        buffers = [t.numel() for t in self.tensors[self._n_masters:]]
        if [t.numel() for t in saved] != [f.numel() for f in self._flats] + buffers:
            return None  # neither layout: loading says so, as before
        where: list[Optional[tuple[int, int]]] = []
        for v in self.tensors[:self._n_masters]:
            g = next((g for g, f in enumerate(self._flats) if v.numel() > 0
                      and f.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()), None)
            where.append(None if g is None else (g, v.storage_offset() - self._flats[g].storage_offset()))
        return where

    def _cut_state(self, state: dict[str, Any], where: list[Optional[tuple[int, int]]]) -> dict[str, Any]:
        """``state`` (per flat partition, then per buffer) per view, then per buffer: each view's values are its
        slice of its flat partition (``where``)."""
        n_flats, views = len(self._flats or []), self.tensors[:self._n_masters]

        def cut(i: int, value: torch.Tensor) -> torch.Tensor:  # view i's slice of its partition's ``value``
            w = where[i]
            if w is None:
                return torch.zeros(0, dtype=value.dtype, device=value.device)
            return value.reshape(-1)[w[1]:w[1] + views[i].numel()].reshape(views[i].shape).clone()

        def new(old: int) -> list[int]:  # the new indices of old tensor ``old``
            if old >= n_flats:
                return [old - n_flats + len(views)]
            return [i for i, w in enumerate(where) if w is not None and w[0] == old]

        def per_tensor(values: list[torch.Tensor]) -> list[torch.Tensor]:
            return [cut(i, values[w[0]] if w else values[0]) for i, w in enumerate(where)] + \
                [t.clone() for t in values[n_flats:]]

        out = dict(state)
        for key in ("anchor", "error"):
            if state.get(key):
                out[key] = per_tensor(state[key])
        if state.get("outer"):
            moved = {i: {k: cut(i, v) if torch.is_tensor(v) and i < len(views) else v for k, v in s.items()}
                     for old, s in state["outer"]["state"].items() for i in new(int(old))}
            groups = [{**g, "params": list(range(len(self.tensors)))} for g in state["outer"]["param_groups"]]
            out["outer"] = {"state": moved, "param_groups": groups}
        if state.get("in_flight"):
            out["in_flight"] = [self._cut_in_flight(f, where, new) for f in state["in_flight"]]
        return out

    def _cut_in_flight(self, f: dict[str, Any], where: list[Optional[tuple[int, int]]], new: Any) -> dict[str, Any]:
        """An exchange in flight of the flat layout for the views: its tensors (parameters only: the buffers are
        averaged at once) the non-empty views inside its partitions, its snapshot cut likewise, and ``order``, where
        each view's elements lie in the exchange's concatenation (:class:`distkit.sync.exchange.InFlight`)."""
        params, snapshot, order, start = [], [], [], 0
        for k, old in enumerate(int(g) for g in f["params"]):
            for i in new(old):
                w, n = where[i], self.tensors[i].numel()
                assert w is not None
                params.append(i)
                if f["snapshot"]:
                    snapshot.append(f["snapshot"][k].reshape(-1)[w[1]:w[1] + n].reshape(self.tensors[i].shape).clone())
                order.append(torch.arange(start + w[1], start + w[1] + n))
            start += self._flats[old].numel()  # type: ignore[index]
        return {**f, "params": params, "snapshot": snapshot, "order": torch.cat(order) if order else None}
