"""Param mode's compressed exchange (``distributed.param_sync_compression``): the mean over ranks of a flat fp32
tensor (the pseudo-gradient ``anchor - local``) with fewer bytes on the link than an fp32 all-reduce.

Two phases, as a ring all-reduce has (the scheme of DeepSpeed ZeRO++'s quantized gradients): each member of the
averaging group owns one of ``p`` chunks; phase 1 is an all-to-all in which every member sends each owner its
encoded chunk, the owner decodes the ``p`` copies and sums them in fp32; phase 2 encodes that mean and all-gathers
it. Bytes sent per member: ``2 (p-1)/p`` of the payload, the same factor as a ring all-reduce, so the saving is the
codec's at any ``p``: bf16/fp16 half of fp32, int8 a quarter (plus one fp32 scale per block of ``BLOCK``). Every
member decodes the same gathered bytes: the result is identical on every rank.

Codecs: "bf16", "fp16" (a cast; fp16 values beyond its range are clamped to it), "int8" (symmetric, one scale
per block of ``BLOCK`` elements: absmax / 127; per block rather than per tensor, so that one large value costs
precision only in its block. The blocks run over the concatenation of the tensors), "int4" (the same with
absmax / 7 per block of ``BLOCK4``, two values per byte) and "e3m0" (Streaming DiLoCo's 4-bit float, arXiv
2501.18512: a sign bit and a 3-bit exponent, no mantissa; per block of ``BLOCK4`` one fp32 scale, the block's absmax,
and each value the nearest of ``0, ±scale * 2^-e`` for ``e`` in 0..6 (:data:`E3M0_LEVELS`); two values per byte, the
same bytes as int4, and exchanged as int4 is). Engines provide the two collectives on bytes (uint8):
:meth:`~distkit.backends.base.Strategy.exchange_all_to_all` and
:meth:`~distkit.backends.base.Strategy.exchange_all_gather`.

Top-k ("topk:<density>:<bits>:<chunk>", :func:`codec_of` of the config's "topk" and its ``param_sync_topk_*``
keys; SparseLoCo's scheme): per chunk of ``chunk`` elements the ``k = ceil(density * chunk)`` largest magnitudes,
sent as int16 indices within the chunk and ``bits``-bit values (2, 4 or 8; symmetric, one fp32 scale per chunk);
the rest is left to the error feedback. Sparse encodings of different members pick different indices, so an owner
cannot sum them without decoding and a re-encoded mean would be sparse again: top-k is one phase, an all-gather of
every member's encoding, each member decoding the ``p`` encodings and summing them in rank order in fp32 (the same
operations on the same bytes: the same mean on every rank, bit for bit). Bytes sent per member: ``(p-1)`` times
the encoding.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

CODECS = ("none", "bf16", "fp16", "int8", "int4", "e3m0", "topk")
#: int8: elements per scale (4 bytes of scale per 1 KiB of payload, 0.4 %)
BLOCK = 1024
#: int4: elements per scale (64 bytes of values and 4 of scale: 0.53125 bytes per element). Smaller than int8's
#: block: with 15 levels, one large value rounds the rest of its block to zero, so the block is kept short
BLOCK4 = 128
_FP16_MAX = 65504.0
#: e3m0: the magnitudes of the 3-bit codes 0..7, relative to the block's scale (its absmax): zero (code 0, as an IEEE
#: float's lowest exponent code is its zero) and the powers of two 2^-6 .. 2^0 (codes 1..7, exponent ``code - 7``).
#: A code's 4th bit is the sign (a zero's is 0)
E3M0_LEVELS = torch.tensor([0.0] + [2.0 ** (c - 7) for c in range(1, 8)])
#: e3m0: rounding to the nearest level (linear distance; a tie goes to the larger magnitude): the midpoints of
#: consecutive levels, ``2^-7`` and ``1.5 * 2^(c - 8)`` for codes 2..7 (all exact in fp32)
_E3M0_EDGES = (E3M0_LEVELS[:-1] + E3M0_LEVELS[1:]) / 2
#: "topk" with the defaults of its keys (param_sync_topk_density, _bits, _chunk in distkit/config/schema.py)
TOPK_DEFAULT = "topk:0.03125:4:4096"


def codec_of(d: Any) -> str:
    """The codec string of a ``distributed`` config's ``param_sync_compression`` (what the averager and
    :class:`Exchange` take, and an exchange in flight saves): the value itself, or for "topk" one string with
    its keys, ``"topk:<density>:<bits>:<chunk>"``."""
    if d.param_sync_compression != "topk":
        return str(d.param_sync_compression)
    return f"topk:{float(d.param_sync_topk_density)!r}:{int(d.param_sync_topk_bits)}:{int(d.param_sync_topk_chunk)}"


def is_sparse(codec: str) -> bool:
    """Whether ``codec`` is a top-k codec (exchanged by an all-gather of every member's encoding)."""
    return codec == "topk" or codec.startswith("topk:")


def topk_params(codec: str) -> tuple[int, int, int]:
    """``(k, bits, chunk)`` of a top-k codec string (bare "topk": the keys' defaults): ``k = ceil(density *
    chunk)`` values kept per chunk."""
    _, density, bits, chunk = (TOPK_DEFAULT if codec == "topk" else codec).split(":")
    return max(1, min(int(chunk), math.ceil(float(density) * int(chunk)))), int(bits), int(chunk)


def _unit(codec: str) -> int:
    """Elements per encoding unit: a chunk is a whole number of them."""
    if is_sparse(codec):
        return topk_params(codec)[2]
    return BLOCK if codec == "int8" else BLOCK4 if codec in ("int4", "e3m0") else 1


def _topk_layout(n: int, codec: str) -> tuple[int, int, int, int, int]:
    """``(chunks, k, k padded to whole bytes of values, bits, chunk)`` of ``n`` elements of a top-k codec."""
    k, bits, chunk = topk_params(codec)
    per = 8 // bits
    return n // chunk, k, -(-k // per) * per, bits, chunk


def encoded_size(n: int, codec: str) -> int:
    """Bytes of ``n`` encoded elements (``n`` a multiple of the codec's unit)."""
    if is_sparse(codec):
        chunks, k, kp, bits, _ = _topk_layout(n, codec)
        return chunks * (2 * k + kp * bits // 8 + 4)
    if codec == "int8":
        return n + 4 * (n // BLOCK)
    if codec in ("int4", "e3m0"):
        return n // 2 + 4 * (n // BLOCK4)
    return 4 * n if codec == "fp32" else 2 * n


def _quantise(blocks: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantisation of each row of ``blocks`` (fp32) to the integers ``-levels..levels``: the scale
    absmax / levels per row (1 for an all-zero row), the integers ``round(x / scale)`` (half to even, torch.round)."""
    scale = blocks.abs().amax(dim=1) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale gives zeros
    return torch.round(blocks / scale[:, None]).clamp_(-levels, levels), scale.to(torch.float32)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers ``-(2^(bits-1)-1)..2^(bits-1)-1`` (length a multiple of ``8 // bits``) as bytes: 8 bits as int8;
    4 and 2 bits stored as ``q + 2^(bits-1)`` (never 0), ``8 // bits`` per byte, element ``i`` of a byte's group in
    bits ``bits*i`` upwards (low nibble first)."""
    if bits == 8:
        return q.to(torch.int8).view(torch.uint8).reshape(-1)
    per = 8 // bits
    u = (q.reshape(-1, per).to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)
    out = u[:, 0].clone()
    for i in range(1, per):
        out |= u[:, i] << (bits * i)
    return out


def _unpack(b: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`_pack`: fp32 integers, ``8 // bits`` per byte."""
    if bits == 8:
        return b.view(torch.int8).to(torch.float32)
    per, mask = 8 // bits, (1 << bits) - 1
    q = torch.stack([(b >> (bits * i)) & mask for i in range(per)], dim=1).reshape(-1)
    return q.to(torch.float32) - float(1 << (bits - 1))


def _e3m0_encode(blocks: torch.Tensor) -> torch.Tensor:
    """Each row of ``blocks`` (fp32) as e3m0: the 4-bit codes packed two per byte (low nibble first), then one
    fp32 scale per row (its absmax; 1 for an all-zero row)."""
    scale = blocks.abs().amax(dim=1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = blocks.abs() / scale[:, None]  # in [0, 1]: the absmax itself is exactly 1
    code = torch.bucketize(y, _E3M0_EDGES.to(y.device), right=True)  # edges <= y: the nearest level, ties up
    code = code | ((blocks < 0) & (code > 0)).to(code.dtype) << 3
    u = code.reshape(-1, 2).to(torch.uint8)
    return torch.cat([u[:, 0] | (u[:, 1] << 4), scale.to(torch.float32).view(torch.uint8)])


def _e3m0_decode(data: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`_e3m0_encode`: ``n`` fp32 elements."""
    b = data[:n // 2]
    code = torch.stack([b & 15, b >> 4], dim=1).reshape(-1).to(torch.int64)
    value = E3M0_LEVELS.to(data.device)[code & 7]
    value = torch.where(code >= 8, -value, value).view(-1, BLOCK4)
    return (value * data[n // 2:].clone().view(torch.float32)[:, None]).reshape(-1)


def encode(x: torch.Tensor, codec: str) -> torch.Tensor:
    """``x`` (1-D fp32, length a multiple of the unit) as bytes (1-D uint8, :func:`encoded_size` long)."""
    if codec == "fp32":
        return x.contiguous().view(torch.uint8)
    if codec == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    if codec == "fp16":
        return x.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).view(torch.uint8)
    if is_sparse(codec):
        chunks, k, kp, bits, chunk = _topk_layout(x.numel(), codec)
        blocks = x.view(chunks, chunk)
        index = blocks.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values  # the k largest |x| per chunk
        q, scale = _quantise(blocks.gather(1, index), (1 << (bits - 1)) - 1)
        q = torch.nn.functional.pad(q, (0, kp - k))  # whole bytes of values per chunk
        return torch.cat([index.to(torch.int16).view(torch.uint8).reshape(-1), _pack(q, bits),
                          scale.view(torch.uint8)])
    if codec == "e3m0":
        return _e3m0_encode(x.view(-1, BLOCK4))
    if codec == "int4":
        q, scale = _quantise(x.view(-1, BLOCK4), 7)
        return torch.cat([_pack(q, 4), scale.view(torch.uint8)])
    q, scale = _quantise(x.view(-1, BLOCK), 127)
    return torch.cat([q.to(torch.int8).view(torch.uint8).reshape(-1), scale.view(torch.uint8)])


def decode(data: torch.Tensor, n: int, codec: str) -> torch.Tensor:
    """The inverse of :func:`encode`: ``n`` fp32 elements from ``data``'s bytes."""
    if codec == "fp32":
        return data.view(torch.float32)
    if codec == "bf16":
        return data.view(torch.bfloat16).to(torch.float32)
    if codec == "fp16":
        return data.view(torch.float16).to(torch.float32)
    if is_sparse(codec):
        chunks, k, kp, bits, chunk = _topk_layout(n, codec)
        a, b = 2 * chunks * k, 2 * chunks * k + chunks * kp * bits // 8
        index = data[:a].clone().view(torch.int16).view(chunks, k).to(torch.int64)  # (a copy: aligned for view)
        scale = data[b:b + 4 * chunks].clone().view(torch.float32)
        values = _unpack(data[a:b], bits).view(chunks, kp)[:, :k] * scale[:, None]
        return torch.zeros(chunks, chunk, dtype=torch.float32, device=data.device).scatter_(1, index, values).view(-1)
    if codec == "e3m0":
        return _e3m0_decode(data, n)
    if codec == "int4":
        q = _unpack(data[:n // 2], 4).view(-1, BLOCK4)
        return (q * data[n // 2:].view(torch.float32)[:, None]).reshape(-1)
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
    (4 bytes per element). A top-k codec has one phase (the all-gather of ``mine``, this member's whole encoding,
    started at once: :attr:`phase` is 2 from the start)."""

    def __init__(self, strategy: Any, x: torch.Tensor, codec: str, rows: Optional[torch.Tensor] = None,
                 mine: Optional[torch.Tensor] = None) -> None:
        self.strategy, self.codec, self.n = strategy, codec, x.numel()
        self.p = strategy.averaging_size()
        unit = _unit(codec)
        if is_sparse(codec):  # one phase: every member's whole encoding all-gathered (no owner, no re-encoding)
            self.chunk = -(-self.n // unit) * unit
            if mine is None:
                mine = encode(torch.nn.functional.pad(x.float(), (0, self.chunk - self.n)), codec)
                self.sent: torch.Tensor = decode(mine, self.chunk, codec)[:self.n]
            else:
                self.sent = x
            self.rows: Optional[torch.Tensor] = None
            self.mine: Optional[torch.Tensor] = mine
            self._received: Any = None
            self._gathered: Any = _Done(mine[None]) if self.p == 1 else strategy.start_all_gather(mine)
            return
        self.chunk = -(-self.n // (self.p * unit)) * unit  # elements per owner, a whole number of units
        if rows is None and mine is None:
            padded = torch.nn.functional.pad(x.float(), (0, self.p * self.chunk - self.n))
            rows = torch.stack([encode(c, codec) for c in padded.view(self.p, self.chunk)])  # row j: owner j's chunk
        #: this member's encoded chunks (phase 1's payload) and, after phase 1, its encoded mean (phase 2's)
        self.rows, self.mine = rows, mine
        #: what the others read of this member's x: ``x - sent`` is the error feedback's remainder
        self.sent = torch.cat([decode(r, self.chunk, codec) for r in rows])[:self.n] if rows is not None else x
        self._received = None if self.p == 1 or mine is not None else strategy.start_all_to_all(rows)
        self._gathered = None if mine is None else strategy.start_all_gather(mine)

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
        """The mean (1-D fp32, ``x``'s length), identical on every member: waits for what is still in flight.
        Top-k: every member decodes every member's encoding and sums them in rank order, in fp32."""
        self.second()
        gathered = self._gathered.wait()  # row j: owner j's mean (top-k: member j's encoding)
        if is_sparse(self.codec):
            total = decode(gathered[0], self.chunk, self.codec)
            for j in range(1, self.p):
                total = total + decode(gathered[j], self.chunk, self.codec)
            return (total / self.p)[:self.n]
        return torch.cat([decode(gathered[j], self.chunk, self.codec) for j in range(self.p)])[:self.n]


class _Done:
    """A finished collective (one member: nothing to exchange)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def wait(self) -> torch.Tensor:
        return self.value
