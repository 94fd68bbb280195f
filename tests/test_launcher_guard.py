"""The launcher watcher (:mod:`distkit.launch.guard`) on a real process whose stderr is a log file."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from distkit.launch import guard as launcher_guard
from distkit.launch.procfs import stat_fields

#: a stand-in launcher: writes what a job's log holds before the watcher acts, then waits (as a launcher waiting
#: for a lost host does)
LAUNCHER = ("import sys, time\n"
            "sys.stderr.write('distkit: error: rank 1 stopped responding (no heartbeat for 10 s)\\n')\n"
            "sys.stderr.flush()\n"
            "time.sleep(120)\n")


def test_the_watcher_appends_its_line_to_a_launchers_log_file_and_keeps_every_line_before(tmp_path: Path) -> None:
    """The watcher writes into the launcher's stderr; when that is a file (``mpirun ... 2> job.log``; Open MPI 5 calls it prterun) it must
    append: opened for writing it was truncated, and the job's own lines (the one naming the stopped rank) were
    lost, leaving NULs where they had been."""
    log = tmp_path / "job.log"
    log.write_text("a line the job wrote before\n")
    with open(log, "a") as err:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stderr=err)
    try:
        deadline = time.monotonic() + 60
        while "stopped responding" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        fields = stat_fields(launcher.pid)
        assert fields is not None
        watcher = subprocess.run([sys.executable, "-I", "-S", "-c", launcher_guard.WATCHER, str(launcher.pid),
                                  fields[19], "0.2", "prterun", "ranks 2, 3 stopped responding"], timeout=60)
        assert watcher.returncode == 0
        assert launcher.wait(timeout=60) != 0  # the watcher ended it
    finally:
        launcher.kill()
    text = log.read_text()
    assert "\0" not in text, repr(text)
    lines = text.splitlines()
    assert lines[:2] == ["a line the job wrote before",
                         "distkit: error: rank 1 stopped responding (no heartbeat for 10 s)"], lines
    assert len(lines) == 3 and lines[2].startswith("distkit: prterun (pid ") and "ranks 2, 3 stopped" in lines[2]
