"""A pytest plugin that records where a whole test run's time goes: per test, its xdist worker, its start and end
(epoch seconds) and the CPU seconds of the processes it started and reaped (``RUSAGE_CHILDREN``; forked ranks are
reaped by their launcher, which the test reaps) plus the worker's own; failures with their report.

    PYTHONPATH=scripts PYTEST_ADDOPTS="-p pytest_timeline" TIMELINE_OUT=/tmp/timeline make test
    python scripts/timeline_report.py /tmp/timeline

Writes ``TIMELINE_OUT/<worker>.jsonl`` (one JSON object per test) and ``failed.txt``. Not used by the suite.
"""
from __future__ import annotations

import json
import os
import resource
import time
from typing import Any, Iterator

import pytest

_OUT = os.environ.get("TIMELINE_OUT", "/tmp/timeline")


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    children, own, t0 = _cpu(resource.RUSAGE_CHILDREN), _cpu(resource.RUSAGE_SELF), time.time()
    yield
    record = {"w": worker, "id": item.nodeid, "t0": t0, "t1": time.time(),
              "cpu_children": _cpu(resource.RUSAGE_CHILDREN) - children, "cpu_self": _cpu(resource.RUSAGE_SELF) - own}
    os.makedirs(_OUT, exist_ok=True)
    with open(os.path.join(_OUT, f"{worker}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        os.makedirs(_OUT, exist_ok=True)
        with open(os.path.join(_OUT, "failed.txt"), "a") as f:
            f.write(f"{report.nodeid} ({report.when})\n{str(report.longrepr)[-6000:]}\n=====\n")
