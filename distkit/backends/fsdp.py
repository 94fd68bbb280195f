"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state sharded across
the ranks, gathered per unit for its forward and backward, gradients reduce-scattered in backward.

Launched and joined like the ddp engine (its ``init``, collectives and launchers: ``--nprocs``, torchrun, mpirun,
SLURM), over a device mesh of every rank (grad mode). ``distributed.fsdp`` (:data:`OPTIONS`) chooses the units, whether
a unit frees its gathered parameters after forward, mixed precision and CPU offload.

What keeps it DDP's result:

- rank 0's initial parameters and buffers are broadcast *before* sharding (each rank keeps its slice of its own
  copy: without it the shards would come from N different initialisations);
- the optimizer the script built over the model's parameters is re-pointed at the sharded parameters by name,
  in place (FSDP2 replaces every parameter object), so the script's reference, its scheduler and a factory's
  optimizer all step the shards;
- buffers are not sharded: DDP's rule for them (:mod:`distkit.backends.buffers`) broadcasts rank 0's before the
  forwards DDP would;
- a parameter shared by two modules (GPT-2's ``wte``/``lm_head``) must live in one unit (torch refuses it in two):
  a unit holding a parameter that is also registered outside it is not made a unit of its own, its parameters
  go to the root's unit;
- a module only some ranks run in a step cannot give DDP's result (:mod:`distkit.backends.fsdp_order`): with
  ``find_unused_parameters`` each collective checks the ranks agree on its unit and stops them with the fix.

Hybrid sharding (``shard_group_size``): shard inside groups of consecutive ranks, replicate across them (2-D mesh).

Param mode (:mod:`distkit.backends.fsdp_param`): FSDP2 inside each replica group (``param_sync_group_size``
ranks), each rank's shards averaged with the same shards of the other groups at a sync. Under fault tolerance
(torchft) FSDP2 shards inside each group, the groups average shard by shard through torchft, and a group that heals
takes each rank's shards from the same rank of a live group (:meth:`FSDPStrategy.heal_state`).

A copy of the sharded model (an EMA's ``AveragedModel``) is sharded the same way (:mod:`distkit.backends.fsdp_copy`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from distkit.errors import ConfigError, UnsupportedCombination, UsageError
from distkit import portable
from distkit.portable import group_names, optimizer_state_by_name, optimizer_state_from_names

from .parts import local, persistent_buffers, unused_parameters, whole
from .buffers import DDPBufferRule
from .ddp import DDPStrategy
from .fsdp_copy import COPIER, deep_copy, make_copier, skeleton
from .fsdp_order import collectives

#: ``distributed.fsdp`` keys, their defaults and meaning (also shown by ``distkit keys``' row for the dict)
OPTIONS: dict[str, tuple[Any, str]] = {
    "units": (None, "module class names that each get their own fully_shard unit; None = the classes a Hugging Face "
                    "model lists in _no_split_modules, else each direct child that holds parameters (the elements of "
                    "a ModuleList or ModuleDict child, each)"),
    "reshard_after_forward": (True, "free a unit's gathered parameters after its forward (gathered again in "
                                    "backward: less memory, one more all-gather)"),
    "param_dtype": (None, "MixedPrecisionPolicy: dtype of the gathered parameters for forward/backward "
                          "('bfloat16', 'float16'; None = the parameters' own)"),
    "reduce_dtype": (None, "MixedPrecisionPolicy: dtype the gradients are reduced in (None = param_dtype's)"),
    "cpu_offload": (False, "keep the sharded parameters, gradients and optimizer state in CPU memory "
                           "(CPUOffloadPolicy; on a CPU-only machine it changes nothing)"),
    "shard_group_size": (None, "hybrid sharding (HSDP): shard inside groups of this many consecutive ranks, replicate "
                               "across the groups (a 2-D mesh; gradients reduce-scattered inside a group, all-reduced "
                               "across); None = shard over every rank"),
}
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float32": torch.float32, "fp32": torch.float32}


def fsdp_options(cfg: Any) -> dict[str, Any]:
    """``distributed.fsdp`` with every default filled in; ConfigError (one line, the fix) for an unknown key or a
    value of the wrong kind."""
    given = cfg.distributed.fsdp
    if not isinstance(given, dict):
        raise ConfigError(f"'distributed.fsdp' must be a dict of options ({', '.join(OPTIONS)}), got {given!r}")
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"'distributed.fsdp' has no key {unknown[0]!r}: the keys are {', '.join(OPTIONS)}")
    opts = {k: given.get(k, default) for k, (default, _) in OPTIONS.items()}
    units = opts["units"]
    if units is not None and (isinstance(units, str) or not isinstance(units, (list, tuple))
                              or not all(isinstance(u, str) and u for u in units)):
        raise ConfigError(f"'distributed.fsdp.units' must be a list of module class names (e.g. ['GPT2Block']) or "
                          f"None, got {units!r}")
    for key in ("reshard_after_forward", "cpu_offload"):
        if not isinstance(opts[key], bool):
            raise ConfigError(f"'distributed.fsdp.{key}' must be True or False, got {opts[key]!r}")
    size = opts["shard_group_size"]
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ConfigError(f"'distributed.fsdp.shard_group_size' must be a number of ranks >= 1 or None, got {size!r}")
    if size is not None and cfg.nprocs > 1 and cfg.nprocs % size:
        raise UnsupportedCombination(f"'distributed.fsdp.shard_group_size' {size} does not divide the world size "
                                     f"{cfg.nprocs} (nprocs): use a divisor of the number of ranks")
    for key in ("param_dtype", "reduce_dtype"):
        if opts[key] is not None and opts[key] not in _DTYPES:
            raise ConfigError(f"'distributed.fsdp.{key}' must be one of {', '.join(_DTYPES)} or None, got {opts[key]!r}")
    return opts


class FSDPStrategy(DDPStrategy):
    """torch.distributed + FSDP2's ``fully_shard`` (grad mode)."""

    name = "fsdp"
    #: (its collectives are timed one by one, in forward and backward: :func:`distkit.backends.fsdp_order.collectives`)
    reduces_in_backward = False

    @classmethod
    def before_forks(cls, cfg: RunConfig) -> tuple[str, ...]:
        """``torch._dynamo`` in both modes: ``DTensor``'s constructor (every sharded parameter) is wrapped in
        ``torch._disable_dynamo``, whose first call loads it in every rank; imported once before the forks."""
        return ("torch._dynamo",)

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        super().check_config(cfg)
        other = sorted(set(cfg.distributed.options) - {"find_unused_parameters"})
        if other:
            raise ConfigError(f"'distributed.options' are DistributedDataParallel's keyword arguments ({other[0]!r}); "
                              "backend 'fsdp' takes its options in distributed.fsdp: "
                              f"{', '.join(OPTIONS)}")
        opts = fsdp_options(cfg)  # (one line for an unknown key or a bad value, in both modes)
        if cfg.distributed.reduce_type == "param" and opts["shard_group_size"] is not None:
            raise ConfigError("'distributed.fsdp.shard_group_size' is grad mode's hybrid sharding; in param mode FSDP2 "
                              "shards inside each replica group: set distributed.param_sync_group_size instead")

    def backend_impl(self) -> str:
        return f"torch {torch.__version__} FSDP2 fully_shard ({getattr(self, 'pg_backend', 'gloo')})"

    def forward_is_collective(self, model: nn.Module) -> bool:
        return self.world_size > 1  # each unit's forward all-gathers its parameters

    # -- setup -----------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer,
              lr_scheduler: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                                            fully_shard)

        opts = fsdp_options(self.cfg)
        module = self.unwrap(model)
        module.to(self.device)
        # rank 0's initial state everywhere before sharding: each rank keeps its slice of its own copy
        self.broadcast_tensors([*module.parameters(), *module.buffers()])
        first_name = {id(p): n for n, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
        # grad mode: shard over every rank, or inside groups of shard_group_size (HSDP: replicated across them);
        # param mode: inside each replica group (param_sync_group_size ranks), averaged across them at a sync
        size = (self.replicas.size if self.replicas is not None else 1) if self.reduce_type == "param" else \
            opts["shard_group_size"] or self.world_size
        if self.world_size % size:
            raise UnsupportedCombination(f"rank {self.rank}: 'distributed.fsdp.shard_group_size' {size} does not divide "
                                         f"the world size {self.world_size}: use a divisor of the number of ranks")
        # (the device given explicitly: pytorch/pytorch#132471)
        if size == self.world_size:
            mesh = init_device_mesh(self.device.type, (self.world_size,))
        else:  # rows of `size` consecutive ranks: mesh["replicate"] joins the ranks holding the same shards
            mesh2 = init_device_mesh(self.device.type, (self.world_size // size, size),
                                     mesh_dim_names=("replicate", "shard"))
            # grad mode: HSDP, FSDP2 over both dimensions (reduce-scatter in a row, all-reduce across the rows);
            # param mode: FSDP2 inside the row, the averager across
            mesh = mesh2 if self.reduce_type == "grad" else mesh2["shard"]
            if self.replicas is not None:  # the averager's groups: this rank's replica group, its cross group
                self._group, self._cross = mesh2.get_group("shard"), mesh2.get_group("replicate")
        # the ranks that reduce gradients together, among which DDP's rule shares the first one's buffers
        self._shard_group = mesh2.get_group("shard") if self.reduce_type == "param" and size < self.world_size \
            else dist.group.WORLD
        policy = MixedPrecisionPolicy(param_dtype=_DTYPES.get(opts["param_dtype"]),
                                      reduce_dtype=_DTYPES.get(opts["reduce_dtype"]))
        kwargs = {"mesh": mesh, "reshard_after_forward": opts["reshard_after_forward"], "mp_policy": policy,
                  "offload_policy": CPUOffloadPolicy() if opts["cpu_offload"] else OffloadPolicy()}
        hsdp = self.reduce_type == "grad" and size < self.world_size
        self._find_unused = bool(self.cfg.distributed.options.get("find_unused_parameters", False))
        template, why = skeleton(module)  # (before sharding: what a copy of the model is built from)
        path = {id(m): n for n, m in module.named_modules()}
        self.units = units(module, opts["units"])
        unit_paths = [path[id(u)] for u in self.units]

        def shard(root: nn.Module) -> None:
            """fully_shard ``root``'s units (innermost first) and then ``root``, with distkit's collectives."""
            for p in unit_paths:
                fully_shard(root.get_submodule(p), **kwargs)
            fully_shard(root, **kwargs)
            named = [(n or "<root>", m) for n, m in root.named_modules() if isinstance(m, FSDPModule)]
            for i, (_, m) in enumerate(named):  # each unit, and the root
                type(m).__deepcopy__ = deep_copy  # type: ignore[method-assign]  # (FSDP2's refuses any copy)
                gather, scatter, all_reduced = collectives(self, i, [n for n, _ in named], check=self._find_unused)
                m.set_custom_all_gather(gather)
                m.set_custom_reduce_scatter(scatter)
                if hsdp:  # the all-reduce across the replicas is FSDP2's own call: timed from its neighbours
                    m.set_all_reduce_hook(all_reduced)
            root.__dict__[COPIER] = copier

        copier = make_copier(self.device, template, why, shard)
        shard(module)
        self._root = module
        if optimizer is not None:
            repoint(optimizer, first_name, dict(module.named_parameters()))
        n_params = sum(p.numel() * p.element_size() for p in module.parameters())
        # per step, this rank hands the gradients' full size to the reduce-scatters and its shards to the
        # all-gathers: forward, and backward again where the units free them after forward
        grads = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        self._step_bytes = (0 if size == 1 else grads + (2 if opts["reshard_after_forward"] else 1) * n_params // size) \
            + (grads // size if hsdp else 0)  # HSDP: each rank's reduced shard all-reduced across the replicas
        self._buffers = persistent_buffers(module)
        # DDP's rule (buffers are not sharded), where more than one rank reduces gradients together
        if self._buffers and (size if self.reduce_type == "param" else self.world_size) > 1:
            self._buffer_hook = DDPBufferRule(module, self._sync_buffers, lambda: self.outside_no_sync)
        if self.reduce_type == "param":
            from .fsdp_param import shard_averager

            self.averager = shard_averager(self, module)
        return model, optimizer

    def _sync_buffers(self) -> None:
        """The buffers of the first rank of this rank's shard group (every rank, a HSDP group, a replica group) to
        the others of it: DDP's rule on the ranks that reduce gradients together."""
        import torch.distributed as dist

        leader = dist.get_global_rank(self._shard_group, 0)
        for t in self._buffers:
            self.comm_bytes += t.numel() * t.element_size()
            dist.broadcast(t.data, src=leader, group=self._shard_group)

    # -- per step --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        self._root.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self._root.set_requires_gradient_sync(True)  # type: ignore[operator]

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Accumulation micro-steps: the units keep their unsharded gradients and reduce-scatter the sum at the
        next backward outside it (``set_requires_gradient_sync``), as DDP's ``no_sync`` all-reduces it."""
        return self._no_sync()

    def clip_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Collective: the global norm over every shard (DTensor-aware ``clip_grad_norm_``), returned whole."""
        norm = torch.nn.utils.clip_grad_norm_(self.unwrap(model).parameters(), max_norm)
        return float(whole(norm))

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer steps the shards. A trainable parameter without gradient (no rank used it: a unit no
        forward ran reduces nothing) is DDP's error unless ``find_unused_parameters`` is set, as under DDP; with
        it the parameter keeps no gradient and the optimizer skips it, DDP's rule."""
        if not self._find_unused:
            missing = [n for n, p in self.unwrap(model).named_parameters() if p.requires_grad and p.grad is None]
            if missing:
                raise unused_parameters(self.rank, missing)
        self.comm_bytes += self._step_bytes
        super().step(model, optimizer)

    # -- state -----------------------------------------------------------------------------------------
    def full_named_parameters(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: every parameter gathered whole (the same order on every rank)."""
        named = [(n, whole(p).detach().clone()) for n, p in self.unwrap(model).named_parameters()]
        yield from named

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Param mode's rank file (the replica groups differ between syncs): this group's model and optimizer
        whole, by name (collective inside the group)."""
        sd, optim_state, groups = self.portable_state(model, optimizer, lambda name: True)
        return {"model": sd, "optimizer": {"state": optim_state, "param_groups": groups}}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Collective inside the group: restore what :meth:`state_dict` wrote; a None entry is left as it is."""
        if state.get("model") is None:
            return
        saved = state.get("optimizer")
        self.load_portable_state(model, optimizer if saved is not None else None, state["model"],
                                 (saved or {}).get("state", {}), (saved or {}).get("param_groups", []))

    def portable_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                       keep: Any) -> portable.State:
        """Collective: every sharded tensor is gathered whole on every rank (the same order everywhere: torch's
        state-dict helpers), then only the names ``keep`` accepts are kept."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        module = self.unwrap(model)
        full = StateDictOptions(full_state_dict=True)
        sd = {k: v.detach().cpu() for k, v in get_model_state_dict(module, options=full).items() if keep(k)}
        if optimizer is None:
            return sd, {}, []
        if not optimizer.state:  # (torch's helper would first make a state by a step of lr 0: Adam's count 1)
            return sd, {}, optimizer_state_by_name(optimizer.state_dict(), group_names(module, optimizer))[1]
        osd = get_optimizer_state_dict(module, optimizer, options=full)  # keyed by parameter name
        state = {n: {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                 for n, s in osd["state"].items() if keep(n)}
        return sd, state, [dict(g) for g in osd["param_groups"]]

    def load_portable_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                            sd: dict[str, torch.Tensor], optim_state: dict[str, dict[str, Any]],
                            groups: list[dict[str, Any]]) -> None:
        """Collective: whole tensors (every rank holds all of them) cut into this rank's shards."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        module = self.unwrap(model)
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(module, sd, options=full)
        if optimizer is None or not groups:
            return
        if not optim_state:  # saved before a step: the groups' settings only, no state to shard
            optimizer.load_state_dict(optimizer_state_from_names({}, groups, group_names(module, optimizer)))
            return
        # (strict=False: a parameter no step used yet has no state, as under DDP, and keeps none)
        set_optimizer_state_dict(module, optimizer, {"state": optim_state, "param_groups": groups},
                                 options=StateDictOptions(full_state_dict=True, strict=False))


    # -- fault tolerance: a heal rank by rank --------------------------------------------------------------
    heals_rank_by_rank = True

    def heal_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> portable.State:
        """Not collective (torchft's quorum thread asks for it): this rank's shards of the parameters and of their
        optimizer state by name (plain tensors), the whole buffers, the param groups. The same rank of another
        group with as many ranks holds the same shards (the same units cut the same way)."""
        module = self.unwrap(model)
        with torch.no_grad():
            sd = {n: local(t).detach().cpu().clone() for n, t in module.state_dict().items() if torch.is_tensor(t)}
            if optimizer is None:
                return sd, {}, []
            state, groups = optimizer_state_by_name(optimizer.state_dict(), group_names(module, optimizer))
            return sd, {n: {k: local(v).detach().cpu().clone() if torch.is_tensor(v) else v for k, v in st.items()}
                        for n, st in state.items()}, groups

    def load_heal_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                        state: portable.State) -> None:
        """Not collective: :meth:`heal_state`'s output of the same rank of a live group into this rank's shards."""
        from torch.distributed.tensor import DTensor

        sd, optim_state, groups = state
        module = self.unwrap(model)
        tensors = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers())}
        with torch.no_grad():
            for name, value in sd.items():
                local(tensors[name]).copy_(value)
        if optimizer is None or not groups:
            return
        params = dict(module.named_parameters())

        def placed(name: str, key: str, v: Any) -> Any:
            """A shard of parameter ``name``'s state (its local shape) as a DTensor placed as the parameter."""
            p = params[name]
            if key == "step" or not torch.is_tensor(v) or v.shape != local(p).shape or not isinstance(p, DTensor):
                return v
            return DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())

        placed_state = {n: {k: placed(n, k, v) for k, v in st.items()} for n, st in optim_state.items()}
        optimizer.load_state_dict(optimizer_state_from_names(placed_state, groups, group_names(module, optimizer)))

def units(module: nn.Module, names: Optional[list[str]]) -> list[nn.Module]:
    """The submodules that get their own ``fully_shard`` unit, innermost first: those whose class is named in
    ``names``, else in the model's ``_no_split_modules`` (Hugging Face), else each direct child that holds
    parameters, where a child that is a container without a forward (``nn.ModuleList``, ``nn.ModuleDict``, which
    ``fully_shard`` refuses) stands for its own children, so a list of blocks gives a unit per block (torchtitan's
    choice). One holding a parameter also registered outside it (tied weights) is left out: its
    parameters go to the root's unit. ConfigError when ``names`` matches no submodule."""
    chosen = names or getattr(module, "_no_split_modules", None)
    if chosen:
        found = [(p, m) for p, m in module.named_modules() if m is not module and type(m).__name__ in set(chosen)]
        if names and not found:
            classes = sorted({type(m).__name__ for m in module.modules()})
            error = ConfigError(f"'distributed.fsdp.units' {list(names)} names no module of the model: its classes "
                                f"are {', '.join(classes)}: name some of them, or leave units unset")
            error.agreed = True  # every rank finds it in the same model, at the same point: reported once (rank 0)
            raise error
    else:
        found = [(p, m) for p, m in _children(module) if any(True for _ in m.parameters())]
    where: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        where.setdefault(id(p), []).append(name)
    out = []
    for prefix, unit in reversed(found):  # named_modules is parents first: reversed, children come first
        inside = prefix + "."
        if all(all(n.startswith(inside) for n in where[id(p)]) for p in unit.parameters()):
            out.append(unit)
    return out


def _children(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """``module``'s direct children by path, each container without a forward replaced by its own children."""
    out = []
    for name, child in module.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out += _children(child, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", child))
    return out


def repoint(optimizer: torch.optim.Optimizer, first_name: dict[int, str], sharded: dict[str, nn.Parameter]) -> None:
    """Point ``optimizer``'s param groups, built over the model's parameters before ``fully_shard`` replaced them,
    at the sharded parameters of the same names, in place. UsageError for a parameter that is not the model's,
    or an optimizer that already holds state (it would be whole, not sharded)."""
    if optimizer.state:
        raise UsageError("dk.setup: the optimizer already holds state (it stepped, or a state was loaded into it): "
                         "with backend 'fsdp' pass a fresh optimizer and load checkpoints with dk.load after setup")
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            if id(p) not in first_name:
                raise UsageError("dk.setup: the optimizer holds a parameter that is not the model's: build it over "
                                 "model.parameters() of the model given to setup")
            params.append(sharded[first_name[id(p)]])
        group["params"] = params
