"""Built-in tasks: sizes and splits as documented."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from distkit.tasks import charlm, digits


def test_digits_split_is_fixed() -> None:
    train, evl = digits.datasets()
    assert len(train) == 1437 and len(evl) == 360
    assert train.tensors[0].shape == (1437, 64) and 0.0 <= float(train.tensors[0].max()) <= 1.0
    assert torch.equal(digits.datasets()[1].tensors[1], evl.tensors[1])


@pytest.mark.parametrize("size,lo,hi", [("small", 1.5e5, 3e5), ("medium", 1e6, 3e6), ("large", 8e6, 1.2e7)])
def test_charlm_sizes(size: str, lo: float, hi: float) -> None:
    task = charlm.build(SimpleNamespace(charlm_seq_len=32, charlm_size=size))  # type: ignore[arg-type]
    model = task.model_fn()
    n = sum(p.numel() for p in model.parameters())
    assert lo <= n <= hi
    x, y = task.train[0:2]
    assert torch.equal(x[:, 1:], y[:, :-1])  # next-character targets
    assert model(x).shape == (2, 32, n and model.head.out_features)


def test_charlm_is_causal() -> None:
    task = charlm.build(SimpleNamespace(charlm_seq_len=16, charlm_size="small"))  # type: ignore[arg-type]
    model = task.model_fn().eval()
    x = task.train[0:1][0]
    x2 = x.clone()
    x2[0, 10:] = (x2[0, 10:] + 1) % model.head.out_features
    with torch.no_grad():
        assert torch.allclose(model(x)[0, :10], model(x2)[0, :10], atol=1e-5)  # no peeking at the future


def test_charlm_stdlib_corpus_holds_the_slow_link_study_without_repeating() -> None:
    # 15,000 steps x 2 ranks x 16 windows: pydoc would be passed 73 times over
    train, evl, vocab = charlm.datasets(64, "stdlib")
    assert len(train) >= 15_000 * 32 and len(charlm.datasets(64)[0]) * 70 < 15_000 * 32
    text = charlm.corpus("stdlib")
    assert text.isascii() and vocab == len(set(text)) <= 128
    assert len(evl) == (len(text) - int(len(text) * 0.99) - 1) // 64  # the last 1 %
    x, y = train[0:1]
    assert "".join(sorted(set(text)))[int(x[0, 0])] == text[0] and torch.equal(x[0, 1:], y[0, :-1])
