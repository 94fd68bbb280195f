"""Param mode's compressed exchange across fault-tolerant groups (``distributed.param_sync_compression`` with
``fault_tolerance``): what crosses torchft's link at a sync is each group's encoded pseudo-gradient, not its fp32
parameters.

The exchange. torchft's Manager offers one collective that survives a group's death, ``allreduce`` (over its
reconfigurable gloo group of the quorum's participants), and no all-gather. An all-gather of byte payloads is built
from it: a ``(P, m)`` uint8 buffer of ``P`` slots (``P`` the sync's participants, ``m`` the encoding's bytes), in
which each participant writes its encoding into its own slot (its rank in the quorum, torchft's
``participating_rank``) and leaves the others zero; the SUM all-reduce of that buffer is every participant's
encoding, exact (each byte is one payload's byte plus zeros). A group that heals at the sync takes no part: its
buffer is all zeros (torchft zeroes a non-participant's tensor too). Every participant then decodes the ``P``
encodings and sums them in slot order in fp32, divides by ``P``: the same operations on the same bytes in every group,
so every replica holds the same mean, bit for bit. One phase for every codec (int8, int4, e3m0 and bf16/fp16 as top-k
has in one job, :class:`distkit.sync.compression.Exchange`): the two-phase exchange of one job (each member owns a
chunk, sums it and re-encodes the mean) needs the participants' number before the quorum forms, and a torchft sync
learns it only then. Bytes: the all-reduce of ``P`` slots hands ``P * E`` bytes to the collective (``E`` the
encoded size of the padded pseudo-gradient), against ``4 n`` for the fp32 average: what ``comm_bytes`` (hence the
averager's ``sync_bytes``) counts.

The rule of a sync (:class:`CodecExchange`), for the parameters the averager holds an anchor of:

* each group sends ``d = anchor - local + e`` (``e`` its error feedback), encoded; ``sent`` is what the others read
  of it (the decoding of its own slot) and ``kept = d - sent`` its error feedback for the next sync, written only
  when the sync commits (a failed sync changes nothing: every group keeps its model, anchor and error feedback, and
  the next sync's pseudo-gradient holds the whole progress since the last committed one);
* the result is ``anchor - mean`` with ``mean = sum(decode(slot_j)) / P``. Without the outer optimizer it becomes
  the model and the anchor; with it, the averager's outer step takes ``anchor - result`` as its gradient, as it
  does after a plain fault-tolerant sync (the mean through one rounding of ``anchor - mean``: the groups stay
  identical; a one-job run applies the mean itself);
* floating buffers and modules kept in sync (``dk.keep_in_sync``) are averaged in fp32 as without compression, in
  a second all-reduce of the same quorum.

Error feedback lives in the averager (``ParamAverager._error``): in each rank's checkpoint file and in the state a
live group serves to one that heals. A whole-job restart, or one group resumed at the sync the others wait in, sends
what the uninterrupted run sends (the same run, bit for bit). **A group that heals starts with zero error feedback**:
the state it receives holds the live group's error feedback, the part of that group's own pseudo-gradients the codec
has not carried yet; kept, it would be sent twice (by its group and by the healed one), and the healed group's own
period, whose remainder its error feedback was, is discarded by the heal.

``DISTKIT_FT_PAYLOADS=DIR`` (tests): at each committed compressed sync each rank saves what it sent and got to
``DIR/group<G>-rank<R>-step<S>.pt``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from distkit.sync.compression import _unit, decode, encode, encoded_size


@dataclass
class Pending:
    """One sync's compressed part, from before the quorum to its commit.

    ``positions``: where the compressed tensors lie in the list handed to the sync; ``index``: their indices in the
    averager's tensors; ``plain``: the positions of the rest (floating buffers, kept modules), averaged in fp32;
    ``local``: the compressed tensors, flat fp32, as this group trained them, and ``anchor`` theirs (both only
    with ``DISTKIT_FT_PAYLOADS``, for the test record; else empty); ``delta``: the pseudo-gradient sent
    (``anchor - local`` plus the error feedback, padded to the codec's unit); ``payload``: its encoding;
    ``sent``: what the others read of ``delta`` (``payload`` decoded); ``slots``: the ``(P, m)`` buffer of the
    all-gather, filled once the quorum is known."""

    positions: list[int]
    index: list[int]
    plain: list[int]
    n: int
    local: torch.Tensor
    error: torch.Tensor
    anchor: torch.Tensor
    delta: torch.Tensor
    payload: torch.Tensor
    sent: torch.Tensor
    slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.uint8))
    slot: Optional[int] = None


class CodecExchange:
    """The compressed exchange of one rank's averager across the groups (see the module's docstring).

    Args:
        averager: this rank's :class:`~distkit.sync.averager.ParamAverager`, built with ``codec`` (so it holds an
            anchor and error feedback). Its own compressed path (an exchange over the engine's ranks, which here are
            one group's) is switched off: the sync hands it the whole model as a plain sync, and
            :class:`~distkit.ft.groups.FaultTolerance.average` runs this exchange across the groups instead.
        codec: :func:`distkit.sync.compression.codec_of` of the config.
    """

    def __init__(self, averager: Any, codec: str) -> None:
        self.averager, self.codec = averager, codec
        # the averager's sync then goes through Strategy.average_parameters, hence FaultTolerance.average (one quorum
        # per sync, the buffers with it); its anchor and error feedback stay as built for the codec
        averager.compression = "none"
        self.dump_dir = os.environ.get("DISTKIT_FT_PAYLOADS") or None

    def prepare(self, tensors: list[torch.Tensor]) -> Optional[Pending]:
        """Before the quorum (nothing collective): split ``tensors`` into the averager's parameters (compressed)
        and the rest, take this group's pseudo-gradient and encode it. None when none of them is compressed."""
        a = self.averager
        where = {id(t): i for i, t in enumerate(a.tensors) if a.is_parameter(i)}
        positions = [k for k, t in enumerate(tensors) if id(t) in where and a._anchor]
        if not positions:
            return None
        index = [where[id(tensors[k])] for k in positions]
        plain = [k for k in range(len(tensors)) if k not in set(positions)]
        with torch.no_grad():
            n = sum(a.tensors[i].numel() for i in index)
            # the model and its anchor, flat, only for the test record (DISTKIT_FT_PAYLOADS): two copies of the model
            # a sync need not make otherwise
            local, anchor = ((torch.cat([a.tensors[i].detach().reshape(-1).float() for i in index]),
                              torch.cat([a._anchor[i].detach().reshape(-1).float() for i in index]))
                             if self.dump_dir is not None else (torch.empty(0), torch.empty(0)))
            error = (torch.cat([a._error[i].reshape(-1) for i in index]) if a.error_feedback and a._error is not None
                     else torch.zeros(n, dtype=torch.float32, device=a.tensors[index[0]].device))
            # the averager's own operations (PseudoGradientExchanges._delta, then Exchange's padding), so that the
            # bytes sent are those one job of the same replica groups sends
            delta = torch.cat([(a._anchor[i] - a.tensors[i]).detach().reshape(-1).float() for i in index])
            if a.error_feedback:
                delta += error
            delta = torch.nn.functional.pad(delta, (0, -n % _unit(self.codec)))
            payload = encode(delta, self.codec)
            sent = decode(payload, delta.numel(), self.codec)
        return Pending(positions, index, plain, n, local, error, anchor, delta, payload, sent)

    def slots(self, pending: Pending, slot: Optional[int], participants: int) -> torch.Tensor:
        """The all-gather's buffer once the quorum is known: ``participants`` zero rows, this group's payload in row
        ``slot`` (None: a healing group, which sends nothing)."""
        # (no participants: the quorum failed, the all-reduce is torchft's no-op and the sync will not commit)
        pending.slot = slot if slot is not None and slot < participants else None
        pending.slots = torch.zeros(participants, pending.payload.numel(), dtype=torch.uint8,
                                    device=pending.payload.device)
        if pending.slot is not None:
            pending.slots[pending.slot] = pending.payload
        return pending.slots

    def mean(self, pending: Pending) -> torch.Tensor:
        """The mean of the gathered encodings: each slot decoded and summed in slot order, in fp32, divided by the
        participants (the same bytes and operations in every group)."""
        rows, m = pending.slots, pending.delta.numel()
        total = decode(rows[0], m, self.codec)
        for j in range(1, rows.shape[0]):
            total = total + decode(rows[j], m, self.codec)
        return (total / rows.shape[0])[:pending.n]

    def committed(self, pending: Pending, tensors: list[torch.Tensor], healed: bool, group: int, rank: int,
                  step: int) -> None:
        """After a committed sync (and, where this group healed, after it took a live group's state): the
        compressed tensors become ``anchor - mean`` (the anchor too, without the outer optimizer), and the error
        feedback what this group's payload did not carry (zero in a group that healed: see the module)."""
        a = self.averager
        mean = self.mean(pending)
        with torch.no_grad():
            # the anchor the result starts from: a healed group's is the live group's, just loaded
            base = torch.cat([a._anchor[i].detach().reshape(-1).float() for i in pending.index])
            result = base - mean
            kept = (pending.delta - pending.sent)[:pending.n] if pending.slot is not None and not healed else \
                torch.zeros(pending.n, device=pending.delta.device)
            offset = 0
            for k, i in zip(pending.positions, pending.index, strict=True):
                t = tensors[k]
                part = result[offset:offset + t.numel()].view_as(t)
                t.copy_(part)
                if a._outer is None:  # (with it, the averager's outer step moves the anchor)
                    a._anchor[i].copy_(part)
                if a.error_feedback:
                    if a._error is None:
                        a._error = [torch.zeros(x.numel(), dtype=torch.float32, device=x.device) for x in a.tensors]
                    a._error[i] = kept[offset:offset + t.numel()].clone()
                offset += t.numel()
        if self.dump_dir is not None:
            os.makedirs(self.dump_dir, exist_ok=True)
            torch.save({"local": pending.local, "anchor": pending.anchor, "error": pending.error,
                        "delta": pending.delta[:pending.n], "sent": pending.sent[:pending.n], "kept": kept,
                        "payload": pending.payload, "slots": pending.slots, "slot": pending.slot, "base": base,
                        "mean": mean, "result": result, "healed": healed, "codec": self.codec,
                        "encoded_size": encoded_size(pending.delta.numel(), self.codec)},
                       os.path.join(self.dump_dir, f"group{group}-rank{rank}-step{step}.pt"))
