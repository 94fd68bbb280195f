"""``charlm``: a small causal transformer over text that ships with Python, so nothing is downloaded.

Two corpora (``charlm_corpus``):

- ``pydoc`` (default): CPython's ``pydoc_data.topics``, ~465k characters of English documentation;
  the last 10 % is the eval split. distkit's benchmark workload.
- ``stdlib``: the source of the running Python's standard library (every ``.py`` file under
  ``sysconfig``'s stdlib path, site-packages excluded, in sorted path order), non-ASCII characters
  replaced by one stand-in symbol: 31.5M characters for CPython 3.11.7, enough for 15,000 steps of
  32 samples of 65 characters without repeating the data (runs that long overfit ``pydoc``: it is
  73 passes over it). The eval split is the last 1 % (315k characters), so evaluating stays cheap.
  The text depends on the Python version: compare runs made with the same one.

Samples are non-overlapping windows of ``charlm_seq_len + 1`` characters.

Sizes (parameters, with the ~100-symbol vocabulary): small ~0.2M, medium ~1.8M, large ~10.7M.
"""
from __future__ import annotations

import functools
import os
import re
import sysconfig
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from .base import Task

if TYPE_CHECKING:
    from distkit.config import RunConfig

#: name -> (model width, layers, heads)
SIZES: dict[str, tuple[int, int, int]] = {"small": (64, 4, 4), "medium": (192, 4, 6), "large": (384, 6, 8)}
#: corpus name -> fraction of its characters (the end of the text) that is the eval split
CORPORA: dict[str, float] = {"pydoc": 0.1, "stdlib": 0.01}
#: what replaces a non-ASCII character in the ``stdlib`` corpus
_OTHER = "\x7f"


@functools.lru_cache(maxsize=2)
def corpus(name: str = "pydoc") -> str:
    """The text of corpus ``name`` (see the module docstring)."""
    if name == "pydoc":
        from pydoc_data.topics import topics

        return "\n".join(topics[k] for k in sorted(topics))
    if name != "stdlib":
        raise ValueError(f"unknown charlm corpus {name!r}; one of {', '.join(CORPORA)}")
    root = sysconfig.get_paths()["stdlib"]
    parts = []
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        for f in sorted(files):
            if f.endswith(".py"):
                with open(os.path.join(here, f), encoding="utf-8", errors="replace") as fh:
                    parts.append(fh.read())
    text = "\n".join(parts)
    return text if text.isascii() else re.sub(r"[^\x00-\x7f]", _OTHER, text)


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


def datasets(seq_len: int, name: str = "pydoc") -> tuple[TensorDataset, TensorDataset, int]:
    """(train windows, eval windows, vocabulary size) of corpus ``name``; the vocabulary is its
    characters in code-point order (ids are the same on every rank and every run)."""
    text = corpus(name)
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    present = np.zeros(int(codes.max()) + 1, dtype=bool)
    present[codes] = True
    index = np.cumsum(present) - 1  # code point -> its place among the corpus's code points, in order
    ids = torch.from_numpy(index[codes].astype(np.int64))
    vocab = int(present.sum())
    split = int(len(ids) * (1 - CORPORA[name]))

    def windows(t: torch.Tensor) -> TensorDataset:
        n = (len(t) - 1) // seq_len
        x = t[: n * seq_len].view(n, seq_len)
        y = t[1 : n * seq_len + 1].view(n, seq_len)
        return TensorDataset(x, y)

    return windows(ids[:split]), windows(ids[split:]), vocab


def build(cfg: "RunConfig") -> Task:
    seq_len = cfg.charlm_seq_len
    train, evl, vocab = datasets(seq_len, getattr(cfg, "charlm_corpus", "pydoc"))
    width, layers, heads = SIZES[cfg.charlm_size]
    return Task("charlm", lambda: CharTransformer(vocab, seq_len, width, layers, heads), train, evl)
