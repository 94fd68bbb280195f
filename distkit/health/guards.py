"""Guards around a user's script: what turns a silent difference or a traceback into one line naming the fix.

* :func:`install_excepthook`: an uncaught DistkitError prints one line and exits with its status; any
  uncaught error first lets the engine stop the other ranks.
* :func:`name_missing_module`: ``model.module`` on an engine that returns the model unwrapped says so.
* :func:`guard_raw_clip`: ``torch.nn.utils.clip_grad_norm_`` on a ZeRO model's parameters (which hold
  no gradient there) raises instead of never clipping.
* :class:`LossWatch`: a NaN or infinite loss stops training before its optimizer step.
* :func:`setup_optimizer`, :func:`check_backward`, :func:`check_step`: the arguments of ``dk.setup`` and
  ``dk.backward``, and the number of backward passes per step on an engine that takes a fixed number.

Each is installed by :class:`distkit.Session` (``init``, ``setup``, ``backward``); none imports it."""
from __future__ import annotations

import contextlib
import math
import os
import sys
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from distkit.errors import DistkitError, NonFiniteLoss, UsageError, report_agreed
from distkit.launch.spawner import record_failure, settle_if_peer
from distkit.health.lost import lost_peer_error

if TYPE_CHECKING:
    from distkit.health.protocols import SessionLike, StrategyLike

_HOOKED = False


def install_excepthook(current: Callable[[], Optional[SessionLike]]) -> None:
    """Uncaught DistkitErrors print one line (no traceback) and exit with their status; an uncaught
    error of any kind first lets the engine stop the other ranks (MPI_Abort) so none waits forever.
    ``current()`` returns the open Session, if any (:attr:`distkit.Session.current`)."""
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Optional[TracebackType]) -> None:
        session = current()
        exc = explained(exc, session)
        if session is not None:
            record_failure(session.rank, exc)
            settle_if_peer(exc, session.world_size)
        if isinstance(exc, DistkitError) and exc.agreed and session is not None:
            # every rank raised this same error at the same point (agreed by a collective): nobody waits for
            # anybody, so no abort; one line for the job, from rank 0, then the ranks leave together (a launcher
            # that ends the job at its first non-zero exit would else cut rank 0 off before the line)
            report_agreed(exc, session.rank)
            with contextlib.suppress(BaseException):
                session.close()
            sys.stdout.flush()
            os._exit(exc.exit_code)
        if session is not None and session.world_size > 1:
            with contextlib.suppress(BaseException):
                try:
                    raise exc
                except BaseException:
                    session.abort()  # prints "rank r failed: ..." and ends the job (MPI engines)
            lost = lost_peer_error(exc)  # (found by abort: at once)
            if lost is not None:
                previous(kind, exc, tb)
                exc = lost
        if isinstance(exc, DistkitError):
            named = session is None or session.world_size == 1 or f"rank {session.rank}" in str(exc)
            where = "" if named else f" (rank {session.rank})"
            # sys.__stderr__: torch.distributed's own excepthook calls this one with sys.stderr swapped for a buffer
            print(f"distkit: error{where}: {exc}", file=sys.__stderr__ or sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(exc.exit_code)
        previous(kind, exc, tb)

    sys.excepthook = hook


def explained(exc: BaseException, session: Optional[SessionLike]) -> BaseException:
    """A known error of torch's whose text does not say what to do in a distkit script, as a UsageError that does."""
    if (session is not None and "Default process group has not been initialized" in str(exc)
            and not torch.distributed.is_initialized()):
        return UsageError(f"torch.distributed is not initialised on the {session.backend} engine (it talks MPI), so "
                          "torch.utils.data.DistributedSampler (or another torch.distributed call) cannot find the "
                          "world size: pass the dataset to dk.dataloader (it shards on every engine), or give "
                          "DistributedSampler num_replicas=dk.world_size, rank=dk.rank")
    return exc


class _NoModuleAttribute(UsageError, AttributeError):
    """``model.module`` on an engine that returns the model unwrapped (an AttributeError, so ``hasattr`` is False)."""


_NAMED_CLASSES: dict[type, type] = {}


def name_missing_module(model: nn.Module) -> None:
    """Make ``model.module`` (DDP's wrapper attribute, which scripts reach for) fail with the fix in its text on
    engines that return the model itself. The model's class is swapped for a subclass that only adds that
    message; it pickles and deep-copies as the original class. (A ``module`` attribute pointing at the model
    itself would make ``hasattr(model, "module")`` true, and unwrapping loops such as Hugging Face's
    ``unwrap_model`` would never end.)"""
    base = type(model)
    if "module" in dir(model) or base in _NAMED_CLASSES.values():
        return
    if base not in _NAMED_CLASSES:
        def __getattr__(self: nn.Module, name: str) -> Any:
            if name == "module":
                raise _NoModuleAttribute(f"'{base.__name__}' object has no attribute 'module': this engine returns "
                                         "the model unwrapped; use dk.unwrap(model) for the bare model on every engine")
            return base.__getattr__(self, name)

        def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
            named = type(self)
            self.__class__ = base
            try:
                return base.__reduce_ex__(self, protocol)
            finally:
                self.__class__ = named

        attrs = {"__getattr__": __getattr__, "__reduce_ex__": __reduce_ex__,
                 "__module__": base.__module__, "__qualname__": base.__qualname__}
        if isinstance(getattr(base, "_orig_cls_mro_index", None), int):
            # FSDP2's classes find the model's own class at this place of their MRO (to construct one, as
            # nn.Sequential's slicing does): one further down below this subclass
            attrs["_orig_cls_mro_index"] = base._orig_cls_mro_index + 1  # type: ignore[attr-defined]
        _NAMED_CLASSES[base] = type(base.__name__, (base,), attrs)
    model.__class__ = _NAMED_CLASSES[base]


def guard_raw_clip(session: SessionLike) -> Callable[[], None]:
    """Where ``param.grad`` does not hold the gradient the engine steps with (ZeRO's partitions), a kept
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), x)`` would see no gradient and never clip: it
    raises UsageError naming the fix instead (for the set-up model's parameters only, while this
    session is open). Returns the function that restores torch's own (:meth:`~distkit.Session.close` calls it).

    torch's ``clip_grad_norm_`` is a thin wrapper (``_no_grad``) around the function that clips; the check
    goes between the two, in the wrapper's closure, so that it also runs for a name a script bound before
    ``distkit.init`` (``from torch.nn.utils import clip_grad_norm_``), which patching the module's attribute
    would miss. Where torch's function has another shape, the module attributes are replaced instead."""
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_module

    original = clip_module.clip_grad_norm_
    inner = getattr(original, "__wrapped__", None)
    cell = next((c for c in (getattr(original, "__closure__", None) or ()) if c.cell_contents is inner), None)
    ids = {id(p) for p in session.unwrap().parameters()}

    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if type(session).current is session and any(id(p) in ids for p in params):
            raise UsageError(f"torch.nn.utils.clip_grad_norm_ on the model's parameters sees no gradients on "
                             f"{session._strategy.backend_impl()} (the engine keeps them partitioned) and would "
                             f"never clip: remove the call and set gradient_clip = {float(max_norm):g} (the engine "
                             "clips inside dk.step), or call dk.clip_grad_norm")
        return (inner if cell is not None else original)(params, max_norm, *args, **kwargs)

    if cell is not None:
        cell.cell_contents = clip_grad_norm_  # every reference to torch's function now checks first

        def restore() -> None:
            cell.cell_contents = inner
    else:
        nn_utils.clip_grad_norm_ = clip_module.clip_grad_norm_ = clip_grad_norm_  # type: ignore[assignment]

        def restore() -> None:
            nn_utils.clip_grad_norm_ = clip_module.clip_grad_norm_ = original  # type: ignore[assignment]

    return restore


def check_scheduler_steps(scheduler: Any, mark: Any) -> None:
    """A scheduler distkit steps at every optimizer step (``dk.setup(..., lr_scheduler)``, interval "step") that the
    script steps too (a per-epoch ``StepLR`` and its ``scheduler.step()`` after each epoch) would be stepped twice,
    silently. ``mark``: its ``last_epoch`` after distkit's last step of it (or setup, or ``dk.load``); called by
    :meth:`distkit.Session.step` before the optimizer step, so a script's step of it is a UsageError naming the fix
    before any optimizer step runs with its learning rate. Not collective: every rank's script makes the same call,
    so every rank raises the same line. (Not a wrapper of ``scheduler.step``: a scheduler's ``state_dict`` is its
    ``__dict__``, which would then hold the wrapper.)"""
    now = getattr(scheduler, "last_epoch", None)
    if now != mark:
        raise UsageError(f"{type(scheduler).__name__}.step() was called by the script (last_epoch {mark} -> {now}), "
                         "but dk.setup was given this scheduler with interval='step' and dk.step() steps it already: "
                         "for a per-epoch schedule pass interval='epoch' (dk.setup(model, optimizer, scheduler, "
                         "interval='epoch')) and keep your scheduler.step(); else remove it")


class LossWatch:
    """The non-finite loss check of :meth:`distkit.Session.backward` (see its docstring): at once on the CPU;
    on other devices the first bad step and its loss are recorded on the device, without a host
    synchronisation, and read by :meth:`raise_if_bad`."""

    def __init__(self) -> None:
        # CUDA only: the first step whose loss was not finite (0: none yet) and that loss, as device scalars
        self._bad_step: Optional[torch.Tensor] = None
        self._bad_loss: Optional[torch.Tensor] = None

    def check(self, loss: torch.Tensor, step: int, rank: int) -> None:
        """NonFiniteLoss if ``loss`` (detached, scalar) of step ``step`` is NaN or infinite: at once on the CPU;
        on other devices only recorded, for :meth:`raise_if_bad`."""
        if loss.device.type == "cpu":
            if not bool(torch.isfinite(loss)):
                raise non_finite(float(loss), step, rank)
            return
        if self._bad_step is None:
            self._bad_step = torch.zeros((), dtype=torch.long, device=loss.device)
            self._bad_loss = torch.zeros((), dtype=torch.float32, device=loss.device)
        assert self._bad_loss is not None
        # only the first bad step is kept: the later ones follow from it
        first = ~torch.isfinite(loss) & (self._bad_step == 0)
        self._bad_step = torch.where(first, torch.full_like(self._bad_step, step), self._bad_step)
        self._bad_loss = torch.where(first, loss.float(), self._bad_loss)

    def raise_if_bad(self, rank: int) -> None:
        """NonFiniteLoss for the first non-finite loss recorded on the device (CUDA), if any: reads two
        scalars, a host synchronisation, so only called at log points, in finish and before a save."""
        if self._bad_step is not None and self._bad_loss is not None:
            step = int(self._bad_step)
            if step:
                raise non_finite(float(self._bad_loss), step, rank)


def non_finite(value: float, step: int, rank: int) -> NonFiniteLoss:
    """The error for loss ``value`` (NaN or infinite) at ``step`` on ``rank``."""
    what = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return NonFiniteLoss(f"rank {rank}: the loss is {what} at step {step}: training stopped; no "
                         "checkpoint of this step or later is written (lower the learning_rate, set gradient_clip, or check "
                         "the data and the loss for nan/inf)")


def setup_optimizer(already: bool, model: Any, optimizer: Any, engine_defines_optimizer: bool) -> Any:
    """The optimizer ``dk.setup(model, optimizer)`` hands the engine (a factory called here, unless the
    engine's config defines the optimizer), or UsageError for arguments that cannot work (``already``: a
    model was set up before)."""
    if already:
        raise UsageError("dk.setup() was already called: one model and optimizer per distkit session "
                         "(wrap several modules in one nn.Module)")
    if not isinstance(model, nn.Module):
        raise UsageError(f"dk.setup(model, ...) needs a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise UsageError(f"dk.setup(model, optimizer): optimizer must be a torch.optim.Optimizer, a "
                             f"factory params -> Optimizer, or None; got {type(optimizer).__name__}")
        optimizer = None if engine_defines_optimizer else optimizer(model.parameters())
    if optimizer is None and not engine_defines_optimizer:
        raise UsageError("dk.setup(model, None): no optimizer; pass one (only a DeepSpeed config with an "
                         "'optimizer' block may leave it out)")
    return optimizer


def check_backward(loss: Any, micro: int, k: int, strategy: StrategyLike) -> None:
    """UsageError unless ``dk.backward(loss)`` can run: ``loss`` a scalar tensor, and, on an engine that takes
    exactly ``k`` (accum_grad_multiple_step) passes per step, fewer than ``k`` passes (``micro``) so far."""
    if strategy.fixed_accumulation and micro >= k:
        raise UsageError(f"dk.backward: {micro + 1} backward passes before dk.step(), but the "
                         f"{strategy.name} engine takes exactly accum_grad_multiple_step = {k} per step: set "
                         "accum_grad_multiple_step to the passes per step (config, or dk.set_accumulation(n) "
                         "before dk.setup)")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise UsageError(f"dk.backward(loss) needs a scalar tensor, got {shape}: reduce it first, e.g. loss.mean()")


def check_step(micro: int, k: int, strategy: StrategyLike) -> None:
    """UsageError for ``dk.step()`` after ``micro`` backward passes on an engine that takes exactly ``k``."""
    if strategy.fixed_accumulation and 0 < micro < k:
        raise UsageError(f"dk.step() after {micro} backward pass(es), but the {strategy.name} engine takes "
                         f"exactly accum_grad_multiple_step = {k} per step: set accum_grad_multiple_step = "
                         f"{micro} (config, or dk.set_accumulation({micro}) before dk.setup)")
