"""Param mode's compressed exchange (``distributed.param_sync_compression``): the mean over ranks of a flat fp32
tensor (the pseudo-gradient ``anchor - local``) with fewer bytes on the link than an fp32 all-reduce.

Two phases, as a ring all-reduce has (the scheme of DeepSpeed ZeRO++'s quantized gradients): each member of the
averaging group owns one of ``p`` chunks; phase 1 is an all-to-all in which every member sends each owner its
encoded chunk, the owner decodes the ``p`` copies and sums them in fp32; phase 2 encodes that mean and all-gathers
it. Bytes sent per member: ``2 (p-1)/p`` of the payload, the same factor as a ring all-reduce, so the saving is the
codec's at any ``p``: bf16/fp16 half of fp32, int8 a quarter (plus one fp32 scale per block of ``BLOCK``). Every
member decodes the same gathered bytes: the result is identical on every rank.

Codecs: "bf16", "fp16" (a cast; fp16 values beyond its range are clamped to it) and "int8" (symmetric, one scale
per block of ``BLOCK`` elements: absmax / 127; per block rather than per tensor, so that one large value costs
precision only in its block. The blocks run over the concatenation of the tensors). Engines provide the two
collectives on bytes (uint8): :meth:`~distkit.backends.base.Strategy.exchange_all_to_all` and
:meth:`~distkit.backends.base.Strategy.exchange_all_gather`.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

CODECS = ("none", "bf16", "fp16", "int8")
#: int8: elements per scale (4 bytes of scale per 1 KiB of payload, 0.4 %)
BLOCK = 1024
_FP16_MAX = 65504.0


def _unit(codec: str) -> int:
    """Elements per encoding unit: a chunk is a whole number of them."""
    return BLOCK if codec == "int8" else 1


def encoded_size(n: int, codec: str) -> int:
    """Bytes of ``n`` encoded elements (``n`` a multiple of the codec's unit)."""
    if codec == "int8":
        return n + 4 * (n // BLOCK)
    return 4 * n if codec == "fp32" else 2 * n


def encode(x: torch.Tensor, codec: str) -> torch.Tensor:
    """``x`` (1-D fp32, length a multiple of the unit) as bytes (1-D uint8, :func:`encoded_size` long)."""
    if codec == "fp32":
        return x.contiguous().view(torch.uint8)
    if codec == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    if codec == "fp16":
        return x.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).view(torch.uint8)
    blocks = x.view(-1, BLOCK)
    scale = blocks.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale gives zeros
    q = torch.round(blocks / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q.view(torch.uint8).reshape(-1), scale.to(torch.float32).view(torch.uint8)])


def decode(data: torch.Tensor, n: int, codec: str) -> torch.Tensor:
    """The inverse of :func:`encode`: ``n`` fp32 elements from ``data``'s bytes."""
    if codec == "fp32":
        return data.view(torch.float32)
    if codec == "bf16":
        return data.view(torch.bfloat16).to(torch.float32)
    if codec == "fp16":
        return data.view(torch.float16).to(torch.float32)
    q = data[:n].view(torch.int8).to(torch.float32).view(-1, BLOCK)
    scale = data[n:].view(torch.float32)
    return (q * scale[:, None]).reshape(-1)


def roundtrip(x: torch.Tensor, codec: str) -> torch.Tensor:
    """What the other ranks will read of ``x`` (``x`` padded to the unit): the error feedback's reference."""
    n = x.numel()
    padded = torch.nn.functional.pad(x, (0, -n % _unit(codec)))
    return decode(encode(padded, codec), padded.numel(), codec)[:n]


class Exchange:
    """One compressed mean of ``x`` over the averaging group (``strategy.averaging_size()`` members, each passing
    the same ``codec`` and a tensor of the same length) in flight, with :func:`encoded_size` bytes per element on
    the link instead of 4: phase 1 an all-to-all of each member's encoded chunks, phase 2 an all-gather of each
    owner's encoded mean, started in turn by the caller so that training steps can run between them
    (``param_sync_overlap``). Collective: every member creates it, calls :meth:`second` and :meth:`result` at
    the same points, in the same order as its other exchanges. ``codec`` "fp32" sends the values as they are
    (4 bytes per element)."""

    def __init__(self, strategy: Any, x: torch.Tensor, codec: str, rows: Optional[torch.Tensor] = None,
                 mine: Optional[torch.Tensor] = None) -> None:
        self.strategy, self.codec, self.n = strategy, codec, x.numel()
        self.p = strategy.averaging_size()
        unit = _unit(codec)
        self.chunk = -(-self.n // (self.p * unit)) * unit  # elements per owner, a whole number of units
        if rows is None and mine is None:
            padded = torch.nn.functional.pad(x.float(), (0, self.p * self.chunk - self.n))
            rows = torch.stack([encode(c, codec) for c in padded.view(self.p, self.chunk)])  # row j: owner j's chunk
        #: this member's encoded chunks (phase 1's payload) and, after phase 1, its encoded mean (phase 2's)
        self.rows, self.mine = rows, mine
        #: what the others read of this member's x: ``x - sent`` is the error feedback's remainder
        self.sent = torch.cat([decode(r, self.chunk, codec) for r in rows])[:self.n] if rows is not None else x
        self._received = None if self.p == 1 or mine is not None else strategy.start_all_to_all(rows)
        self._gathered: Any = None if mine is None else strategy.start_all_gather(mine)

    @property
    def phase(self) -> int:
        return 1 if self._gathered is None else 2

    def second(self) -> None:
        """Wait for phase 1 (the all-to-all), sum this member's chunk and start phase 2 (the all-gather)."""
        if self._gathered is not None:
            return
        if self.p == 1:
            self.mine = self.rows[0]  # type: ignore[index]
            self._gathered = _Done(self.mine[None])
            return
        received = self._received.wait()  # type: ignore[union-attr]  # row j: member j's copy of my chunk
        mean = sum(decode(received[j], self.chunk, self.codec) for j in range(self.p)) / self.p
        self.mine = encode(mean, self.codec)
        self._gathered = self.strategy.start_all_gather(self.mine)

    def result(self) -> torch.Tensor:
        """The mean (1-D fp32, ``x``'s length), identical on every member: waits for what is still in flight."""
        self.second()
        gathered = self._gathered.wait()  # row j: owner j's mean
        return torch.cat([decode(gathered[j], self.chunk, self.codec) for j in range(self.p)])[:self.n]


class _Done:
    """A finished collective (one member: nothing to exchange)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def wait(self) -> torch.Tensor:
        return self.value
