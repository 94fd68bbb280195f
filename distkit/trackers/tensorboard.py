"""TensorBoard: event files under ``output_dir/tensorboard`` (``tensorboard --logdir output_dir/tensorboard``).

Scalars under the names of ``metrics.jsonl`` at the optimizer step; the run's config in the HPARAMS tab (with
``loss`` and ``eval_loss`` as its metrics); the summary's numbers as ``summary/<key>`` at the last step. A resumed
run writes a new event file into the same directory: one run, one step axis.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from distkit.trackers import summary_numbers


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, output_dir: str, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.logdir = os.path.join(output_dir, "tensorboard")
        self.writer = SummaryWriter(self.logdir)
        self.last_step = 0
        # the HPARAMS tab: the experiment (config keys, metric names) and this session's values; its end at finish
        exp, ssi, self._sei = hparams(params, {"loss": 0.0, "eval_loss": 0.0})
        for s in (exp, ssi):
            self.writer.file_writer.add_summary(s)

    def held_through(self) -> int:
        """The last step of a scalar in the directory's event files (0: none), read back with TensorBoard's own
        loader; the summary's ``summary/*`` scalars of a finished start are not counted."""
        import glob

        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        last = 0
        for path in glob.glob(os.path.join(self.logdir, "events.out.tfevents.*")):
            try:
                for event in EventFileLoader(path).Load():
                    if event.HasField("summary") and any(v.tag and not v.tag.startswith(("summary/", "_hparams_"))
                                                         for v in event.summary.value):
                        last = max(last, event.step)
            except Exception:  # a record torn by a kill (TensorBoard's DataLossError): what precedes it counts
                continue
        return last

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.last_step = max(self.last_step, step)
        self.writer.flush()

    def finish(self, summary: Optional[dict[str, Any]], status: str) -> None:
        if summary is not None:
            step = int(summary.get("steps", self.last_step))
            for name, value in summary_numbers(summary).items():
                self.writer.add_scalar(name, value, step)
            self.writer.file_writer.add_summary(self._sei)
        self.writer.close()


def open_tracker(output_dir: str, run_id: str, params: dict[str, Any], resumed: bool) -> TensorBoardTracker:
    return TensorBoardTracker(output_dir, params)
