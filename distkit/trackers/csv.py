"""CSV: ``output_dir/metrics.csv``, one row per record of ``metrics.jsonl`` (``step`` first, then the other columns
in the order they first appeared; an eval row leaves the training columns empty and the other way round). A new
column (the first eval) rewrites the file with the wider header, as Lightning's CSVLogger does. The summary is
not a row: it is ``summary.json``."""
from __future__ import annotations

import csv
import os
from typing import Any, Optional


class CsvTracker:
    name = "csv"

    def __init__(self, output_dir: str, resumed: bool) -> None:
        self.path = os.path.join(output_dir, "metrics.csv")
        self.columns: list[str] = ["step"]
        self.rows: list[dict[str, Any]] = []
        if resumed and os.path.exists(self.path):  # continue the earlier run's table
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or ["step"])
                self.rows = [dict(r) for r in reader]
        self._rewrite()

    def held_through(self) -> int:
        """The last step of the table's rows (0: none)."""
        return max((int(r["step"]) for r in self.rows if str(r.get("step", "")).isdigit()), default=0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, **metrics}
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        if new:
            self.columns += new
            self._rewrite()
        else:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, self.columns).writerow(row)

    def _rewrite(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, self.columns)
            w.writeheader()
            w.writerows(self.rows)
        os.replace(tmp, self.path)  # a crash mid-write leaves the previous table

    def finish(self, summary: Optional[dict[str, Any]], status: str) -> None:
        pass


def open_tracker(output_dir: str, run_id: str, params: dict[str, Any], resumed: bool) -> CsvTracker:
    return CsvTracker(output_dir, resumed)
