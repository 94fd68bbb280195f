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

from typing import Any

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
    return 2 * n


def encode(x: torch.Tensor, codec: str) -> torch.Tensor:
    """``x`` (1-D fp32, length a multiple of the unit) as bytes (1-D uint8, :func:`encoded_size` long)."""
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


def compressed_mean(strategy: Any, x: torch.Tensor, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective over the averaging group (``strategy.averaging_size()`` members, every one passing the same
    ``codec`` and a tensor of the same length): ``(mean, sent)``. ``mean``: the mean of ``x`` (1-D fp32) over the
    group, identical on every member, with :func:`encoded_size` bytes per element on the link instead of 4.
    ``sent``: what the others read of this member's ``x`` (its decoded encoding; ``x - sent`` is the error
    feedback's remainder)."""
    p, n = strategy.averaging_size(), x.numel()
    if p == 1:
        sent = roundtrip(x, codec)  # what crossing the link would have left of it
        return sent, sent
    chunk = -(-n // (p * _unit(codec))) * _unit(codec)  # elements per owner, a whole number of units
    padded = torch.nn.functional.pad(x.float(), (0, p * chunk - n))
    rows = torch.stack([encode(c, codec) for c in padded.view(p, chunk)])  # row j: owner j's chunk
    sent = torch.cat([decode(r, chunk, codec) for r in rows])[:n]
    received = strategy.exchange_all_to_all(rows)  # row j: member j's copy of my chunk
    mine = sum(decode(received[j], chunk, codec) for j in range(p)) / p
    gathered = strategy.exchange_all_gather(encode(mine, codec))  # row j: owner j's mean
    return torch.cat([decode(gathered[j], chunk, codec) for j in range(p)])[:n], sent
