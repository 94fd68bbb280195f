"""``charlm``: a small causal transformer over CPython's ``pydoc_data.topics`` text.

The corpus (~465k characters of English documentation) ships with Python, so nothing is
downloaded. Samples are non-overlapping windows of ``charlm_seq_len + 1`` characters;
the last 10 % of the text is the eval split. This is distkit's benchmark workload.

Sizes (parameters, with the ~100-symbol vocabulary): small ~0.2M, medium ~1.8M, large ~10.7M.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import TensorDataset

from . import Task

if TYPE_CHECKING:
    from distkit.config import RunConfig

#: name -> (model width, layers, heads)
SIZES: dict[str, tuple[int, int, int]] = {"small": (64, 4, 4), "medium": (192, 4, 6), "large": (384, 6, 8)}


@functools.lru_cache(maxsize=1)
def corpus() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


class CharTransformer(nn.Module):
    """Token + position embeddings, pre-norm causal transformer blocks, tied-free LM head."""

    def __init__(self, vocab: int, seq_len: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq_len, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.mask: torch.Tensor
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def datasets(seq_len: int) -> tuple[TensorDataset, TensorDataset, int]:
    text = corpus()
    vocab = sorted(set(text))
    ids = torch.tensor(_encode(text, vocab), dtype=torch.long)
    split = int(len(ids) * 0.9)

    def windows(t: torch.Tensor) -> TensorDataset:
        n = (len(t) - 1) // seq_len
        x = t[: n * seq_len].view(n, seq_len)
        y = t[1 : n * seq_len + 1].view(n, seq_len)
        return TensorDataset(x, y)

    return windows(ids[:split]), windows(ids[split:]), len(vocab)


def _encode(text: str, vocab: list[str]) -> list[int]:
    index = {c: i for i, c in enumerate(vocab)}
    return [index[c] for c in text]


def build(cfg: "RunConfig") -> Task:
    seq_len = cfg.charlm_seq_len
    train, evl, vocab = datasets(seq_len)
    width, layers, heads = SIZES[cfg.charlm_size]
    return Task("charlm", lambda: CharTransformer(vocab, seq_len, width, layers, heads), train, evl)
