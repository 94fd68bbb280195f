"""Issue 23 item 8: ``dk.backward`` stops at the first NaN or infinite loss (a user's own loop on one rank,
in process; the 2-rank ``distkit train`` case is in test_bad_input.py)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import distkit
from distkit.errors import NonFiniteLoss


@pytest.mark.parametrize("factor,word", [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf")])
def test_backward_refuses_a_non_finite_loss_before_the_update(factor: float, word: str, tmp_path: Path) -> None:
    """The error names rank and step (num_steps + 1); raised before the backward pass, so the model and
    its gradients are those of the last good step, and the loop may still save them."""
    dk = distkit.init({"output_dir": str(tmp_path), "seed": 3})
    try:
        model = torch.nn.Linear(4, 1)
        model, _ = dk.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x = torch.ones(2, 4)
        for _ in range(2):
            dk.backward(model(x).mean())
            dk.step()
        before = {k: v.clone() for k, v in dk.unwrap().state_dict().items()}
        with pytest.raises(NonFiniteLoss, match=re.escape(
                f"rank 0: the loss is {word} at step 3: training stopped; no checkpoint of this step or later is "
                "written (lower the learning_rate, set gradient_clip, or check the data and the loss for nan/inf)")):
            dk.backward((model(x).mean() ** 2 + 1) * factor)  # a positive loss times factor
        assert dk.num_steps == 2
        assert all(p.grad is None for p in dk.unwrap().parameters())
        after = dk.unwrap().state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert NonFiniteLoss.exit_code == 1  # a failure during training, not bad input
    finally:
        dk.close()
