"""Weights & Biases: offline (files under ``output_dir/wandb``, uploaded later with ``wandb sync``) unless the user
has configured W&B (``WANDB_MODE``, ``WANDB_API_KEY``, or ``wandb login``'s entry in ~/.netrc), then as configured.
The project is ``WANDB_PROJECT`` (default "distkit"), the run's id distkit's run id (a resumed run continues it,
``resume="allow"``), its name the ``output_dir``'s.

History under the names of ``metrics.jsonl`` at the optimizer step (W&B's ``_step``; an eval record's other keys with
the ``eval_`` prefix, e.g. ``eval_time_s``, as W&B merges a step's records into one row); the config as the run's
config; the summary in the run's summary (the summary's own keys) and its exit code: 0, 75 (preempted) or 1.

W&B writes asynchronously (its ``wandb-core`` process): a rank 0 killed with SIGKILL took every record of that
start with it (32 steps logged, none in the offline file: issue 36 item 15). :meth:`WandbTracker.held_through` says what
the run holds (offline: its earlier ``run-<id>.wandb`` files read back; online: the server's next step), so that a
resumed run replays the rest from ``metrics.jsonl``.
"""
from __future__ import annotations

import glob
import netrc
import os
import struct
from typing import Any, Iterator, Optional

_EXIT = {"finished": 0, "preempted": 75, "failed": 1}


def _configured() -> bool:
    """The user set W&B up: an API key in the environment or from ``wandb login`` (~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbTracker:
    name = "wandb"

    def __init__(self, output_dir: str, run_id: str, params: dict[str, Any]) -> None:
        import wandb

        mode = None if os.environ.get("WANDB_MODE") or _configured() else "offline"
        self.output_dir, self.run_id = output_dir, _wandb_id(run_id)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "distkit", id=self.run_id,
                              name=os.path.basename(os.path.abspath(output_dir)), dir=output_dir, config=params,
                              resume="allow", mode=mode, reinit="create_new")
        self.last_step = 0

    def held_through(self) -> int:
        """The last step whose record the W&B run holds (0: none). Offline: the history records in this run's earlier
        offline files (this start's own file has none yet). Online: the step before the server's next one."""
        if not self.run.offline:
            return max(int(self.run.starting_step) - 1, 0)
        steps = [0]
        for path in glob.glob(os.path.join(self.output_dir, "wandb", "offline-run-*", f"run-{self.run_id}.wandb")):
            steps += [_history_step(rec) for rec in offline_records(path) if rec.WhichOneof("record_type") == "history"]
        return max(steps)

    def log(self, metrics: dict[str, float], step: int) -> None:
        # W&B keeps one history row per step and merges what is logged at it: an eval record at a training record's
        # step overwrote its ``time_s`` (issue 36). Its keys that are not eval metrics get the eval_ prefix.
        if any(k.startswith("eval_") for k in metrics):
            metrics = {k if k.startswith("eval_") else f"eval_{k}": v for k, v in metrics.items()}
        self.run.log(metrics, step=step)
        self.last_step = max(self.last_step, step)

    def finish(self, summary: Optional[dict[str, Any]], status: str) -> None:
        if summary is not None:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        self.run.finish(exit_code=_EXIT[status])


def _wandb_id(run_id: str) -> str:
    """W&B run ids allow letters, digits, ``-`` and ``_`` (at most 64)."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in run_id)[:64]


def _history_step(rec: Any) -> int:
    import json

    return next((int(json.loads(i.value_json)) for i in rec.history.item if i.key == "_step"), 0)


def offline_records(path: str) -> Iterator[Any]:
    """Each whole record (a ``wandb_internal_pb2.Record``) of a W&B offline run file, in order. Its framing is
    LevelDB's log format (32 KiB blocks, 7-byte headers: CRC, length, type FULL/FIRST/MIDDLE/LAST) after W&B's 7-byte
    file header. A record cut by a kill (its tail never written) ends the scan: what precedes it is held."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        return
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is zero-filled
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        if pos + 7 + n > len(data):
            return
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # FULL, LAST: a whole record
            try:
                rec = wandb_internal_pb2.Record.FromString(buf)
            except Exception:  # a torn record (protobuf's DecodeError): nothing after it is trusted
                return
            buf = b""
            yield rec


def open_tracker(output_dir: str, run_id: str, params: dict[str, Any], resumed: bool) -> WandbTracker:
    return WandbTracker(output_dir, run_id, params)
