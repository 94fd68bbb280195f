"""The checkpoint layout's names and the small helpers every checkpoint module shares: step and rank
file names, sha256 of a file, and telling a full disk from other write errors."""
from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
from typing import Optional


#: default of the ``keep_checkpoints`` key: complete checkpoints kept (older ones are deleted
#: after a new one is complete)
KEEP = 3
STEP_RE = re.compile(r"^step-(\d+)$")
_ASIDE_RE = re.compile(r"^\.(step-\d+)\.old$")


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def step_name(step: int) -> str:
    return f"step-{step:07d}"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


#: bytes free on a filesystem below which a short write there is taken for a full disk
_FULL_BELOW = 1 << 20


def _is_no_space(e: BaseException, where: Optional[str] = None) -> bool:
    """A full disk, also when torch reports it as RuntimeError with the OSError as its context, or,
    for a write under ``where``, as a short write with no errno at all (torch's zip writer:
    ``unexpected pos N vs M``), told by that filesystem having less than :data:`_FULL_BELOW` free.
    Call it before the partial files are removed."""
    seen: Optional[BaseException] = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    if "No space left on device" in str(e):
        return True
    if where is not None and "unexpected pos" in str(e):
        try:
            return shutil.disk_usage(_nearest_existing(where)).free < _FULL_BELOW
        except OSError:
            return False
    return False


def _nearest_existing(path: str) -> str:
    """``path`` made absolute, or its nearest parent that exists (the filesystem a new file there lands on)."""
    d = os.path.abspath(path)
    while not os.path.exists(d):
        d = os.path.dirname(d)
    return d


def _step_of(name: str) -> int:
    return int(name.rsplit("-", 1)[1].split(".")[0])
