"""The run's ``output_dir``: its lock (one run per directory), the atomic writes of its JSON files, and
the checks made before any rank starts (:func:`preflight`)."""
from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import socket
import tempfile
import time
from typing import IO, TYPE_CHECKING, Any, Callable, Optional

from distkit.errors import ConfigError, OutputError

from .manifest import fitting_checkpoint
from .paths import _is_no_space, _nearest_existing

if TYPE_CHECKING:
    from distkit.config import RunConfig


def check_output_dir(output_dir: str) -> None:
    """ConfigError unless ``output_dir`` (or, when it does not exist yet, its nearest existing parent)
    and its ``checkpoints/`` accept a new file: a write probe, so root on a read-only mount is caught
    too. Writes nothing that stays."""
    target = os.path.abspath(output_dir)
    d = _nearest_existing(target)
    _check_new_path(output_dir, target, d)
    probe_dirs = [d]
    if d == target and os.path.isdir(os.path.join(target, "checkpoints")):
        probe_dirs.append(os.path.join(target, "checkpoints"))
    for d in probe_dirs:
        if not os.path.isdir(d):
            raise ConfigError(f"output_dir '{output_dir}' cannot be created: '{d}' is a file; choose another "
                              "output_dir")
        try:
            fd, probe = tempfile.mkstemp(prefix=".distkit-write-probe-", dir=d)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise ConfigError(f"output_dir '{output_dir}' is not writable ({e.strerror or e}: '{d}'): choose a "
                              "writable output_dir or fix its permissions") from None


def _check_new_path(output_dir: str, target: str, existing: str) -> None:
    """ConfigError for the part of ``target`` below its nearest existing parent ``existing`` that cannot be
    created: a symlink that resolves to nothing or loops (os.makedirs raised FileExistsError), a name longer
    than the filesystem allows (OSError ENAMETOOLONG)."""
    from distkit.config.loader import not_a_file  # (what a link that does not resolve is: one wording for both)

    p = target
    while p != existing:
        if os.path.islink(p):
            raise ConfigError(f"output_dir '{output_dir}': '{p}' {not_a_file(p)}: fix the link or choose another "
                              "output_dir")
        p = os.path.dirname(p)
    try:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    rest = os.path.relpath(target, existing)
    for part in ([] if rest == os.curdir else rest.split(os.sep)):
        if len(os.fsencode(part)) > name_max:
            raise ConfigError(f"output_dir '{output_dir[:80]}...' has a name of {len(os.fsencode(part))} bytes, longer "
                              f"than this filesystem allows ({name_max}): choose a shorter output_dir")
    if len(os.fsencode(target)) >= 4096:  # PATH_MAX: every file under it would fail to open
        raise ConfigError(f"output_dir '{output_dir[:80]}...' is {len(os.fsencode(target))} bytes long, more than paths "
                          "may be (4095): choose a shorter output_dir")


def open_own(path: str, mode: str) -> IO[str]:
    """Open a run's own file under ``output_dir`` for writing (``mode`` "w" or "a"), never through a symbolic link:
    a link planted there (``metrics.jsonl`` -> a file elsewhere) would make the run overwrite what it points at.
    Raises :class:`OutputError` naming the file."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OutputError(f"'{path}' is a symbolic link: distkit writes its own files in output_dir, never "
                              "through a link; remove it") from None
        raise
    return os.fdopen(fd, mode)


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` (its directory made if missing) atomically: into a hidden temporary
    sibling, flushed to disk, then renamed over ``path``. A failure (a full disk) removes the temporary file
    and leaves the earlier ``path`` as it was, instead of truncated to 0 bytes by an ``open(path, "w")``.
    Raises :class:`OutputError` with one line naming the file and the fix."""
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.tmp")
    try:
        os.makedirs(directory, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):  # a leftover, or a link planted as it: the name, not its target
            os.unlink(tmp)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w") as f:
            json.dump(obj, f, indent=2)
            f.flush()
            os.fsync(f.fileno())  # a full disk surfaces here at the latest, before the old file is replaced
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        what = "no space left on device" if _is_no_space(e) else (e.strerror or str(e))
        before = "the previous one is intact" if os.path.isfile(path) else "it was not written"
        raise OutputError(f"{what} writing '{path}' ({before}): free space or fix the permissions of "
                          f"'{directory}', then continue with ++resume auto") from None


#: the lock file of a run under ``output_dir``: flock-ed by the process that owns the run for its whole life
LOCK_NAME = ".distkit.lock"
#: set by the launching command (``--nprocs``) for the ranks it starts: the output_dir whose lock it holds
LOCK_ENV = "DISTKIT_OUTPUT_DIR_LOCKED"
#: output_dirs (absolute) whose lock this process holds, with the open descriptor that holds it
_LOCKS: dict[str, int] = {}
#: output_dirs this process created for its lock (removed again if nothing else was written in them)
_CREATED: set[str] = set()
#: output_dirs whose lock file this process created (it was not there)
_NEW_LOCK_FILES: set[str] = set()


def holds_lock(output_dir: str) -> bool:
    """Whether this process holds the run's lock on ``output_dir`` (:func:`lock_output_dir`)."""
    return os.path.abspath(output_dir) in _LOCKS


def unlock_output_dir(output_dir: str, refused: bool = False) -> None:
    """Release the lock this process holds on ``output_dir`` (if any): a ``Trainer.fit()`` in a process that
    goes on (a notebook) lets the next run there start. After a run the file stays (the next run reuses it).
    ``refused`` (bad input: nothing may be left behind): a lock file this process created is deleted, while
    still locked; a run that opened it just before then finds the name gone or another file under it, and
    takes the lock again on the file that is there (:func:`lock_output_dir`)."""
    target = os.path.abspath(output_dir)
    fd = _LOCKS.pop(target, None)
    if fd is not None:
        if refused and target in _NEW_LOCK_FILES:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(target, LOCK_NAME))
        os.close(fd)  # closing the only descriptor releases the flock
    _NEW_LOCK_FILES.discard(target)
    if target in _CREATED:
        # A run that failed before writing anything (e.g. its engine did not start) leaves nothing behind:
        # the directory it created holds only the lock file.
        _CREATED.discard(target)
        with contextlib.suppress(OSError):
            if os.listdir(target) == [LOCK_NAME]:
                os.remove(os.path.join(target, LOCK_NAME))
                os.rmdir(target)


def _in_use(output_dir: str, holder: str) -> ConfigError:
    return ConfigError(f"output_dir '{output_dir}' is in use by another distkit run "
                       f"({holder or 'its holder has not recorded itself yet'}): wait for it to end, stop it, or "
                       "choose another output_dir")


def refuse_if_in_use(output_dir: str) -> None:
    """ConfigError naming the holder (pid, host, start) when a live run holds ``output_dir``'s lock and this process
    does not: checked before an existing output_dir's checkpoints are read by a run that does not take the lock
    itself there (a rank under torchrun/mpirun/srun), which said "holds checkpoints of an earlier run" instead.
    Creates nothing; the probe holds a shared lock for a moment only."""
    target = os.path.abspath(output_dir)
    if target in _LOCKS or os.environ.get(LOCK_ENV) == target:
        return
    try:
        fd = os.open(os.path.join(target, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # no lock file (no run there yet), or a link: lock_output_dir says so
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                try:
                    holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
                except OSError:
                    holder = ""
                raise _in_use(output_dir, holder) from None
    finally:
        os.close(fd)  # (releases the shared lock, if taken)


def lock_output_dir(output_dir: str) -> None:
    """Take the run's lock on ``output_dir`` (created if missing): an exclusive ``flock`` on
    ``output_dir/.distkit.lock``, held until this process ends (the kernel releases it when the process
    dies, so a killed run never leaves a stale lock). Two runs on one output_dir would overwrite each
    other's checkpoints, metrics and summary, and collide in the same temporary checkpoint directory.
    Raises ConfigError (exit 2) naming the holder (pid, host, start time, which the holder writes into
    the file) when another run holds it. A no-op when this process holds it already, or when the
    launching command holds it for this rank (:data:`LOCK_ENV`): ranks of one job never refuse each other.
    Assumes a filesystem whose ``flock`` is seen by every process that may start a run on it (local, or
    a shared FS that supports it)."""
    target = os.path.abspath(output_dir)
    if target in _LOCKS or os.environ.get(LOCK_ENV) == target:
        return
    created = not os.path.isdir(target)
    os.makedirs(target, exist_ok=True)
    path = os.path.join(target, LOCK_NAME)
    for _ in range(100):  # (another run's refusal deleting the file we opened: open the one there now)
        new_file = not os.path.lexists(path)
        # not inheritable across exec (PEP 446): a spawned rank gets LOCK_ENV instead; a forked rank shares it
        try:  # never through a symbolic link planted as the lock file
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ConfigError(f"output_dir '{output_dir}': its lock file '{path}' is a symbolic link: distkit "
                                  "writes its own files there, never through a link; remove it") from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            error: Optional[OSError] = e
        else:
            error = None
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except OSError:
                same = False
            if not same:  # locked a file that is no longer under the name: no lock at all
                os.close(fd)
                continue
        break
    else:
        raise ConfigError(f"output_dir '{output_dir}': its lock file '{path}' keeps being replaced (runs starting and "
                          "being refused there all the time): try again, or choose another output_dir")
    if error is not None:
        e = error
        try:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
        except OSError:
            holder = ""
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise ConfigError(f"output_dir '{output_dir}' cannot be locked ({e.strerror or e}: '{path}'): choose an "
                              "output_dir on a filesystem that supports flock") from None
        raise _in_use(output_dir, holder)
    # who holds it, for the message a second run prints (the lock itself is the flock, not this text)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with contextlib.suppress(OSError):  # best effort (a full disk): the flock is held all the same
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, started {started}\n".encode(), 0)
    _LOCKS[target] = fd
    if new_file:
        _NEW_LOCK_FILES.add(target)
    if created:
        _CREATED.add(target)
        atexit.register(unlock_output_dir, target)  # (an exit through os._exit leaves the lock file)


def preflight(cfg: "RunConfig", world_size: int,
              shapes: Optional[Callable[[], Optional[dict[str, list[int]]]]] = None,
              lock: bool = False) -> Optional[str]:
    """Before any rank starts or anything is written: a writable ``output_dir``, and for a resume a
    verified checkpoint that fits ``world_size`` ranks and the model (``shapes()``). Returns the
    checkpoint a resume will use (None: a fresh start). Raises ConfigError/CheckpointError (exit 2).
    With ``lock`` (the process that owns the whole run: a single process, or the command that starts the
    ranks) it also takes the run's lock (:func:`lock_output_dir`), held until this process ends."""
    check_output_dir(cfg.output_dir)
    held = holds_lock(cfg.output_dir)
    # An existing output_dir is locked before its checkpoints are read: another run may be writing them,
    # and "in use by another run" is then the one line to print. A new one is created only once every
    # check passed, so bad input leaves no directory behind.
    if lock and os.path.isdir(cfg.output_dir):
        lock_output_dir(cfg.output_dir)
    elif not held:  # a rank under a launcher: a live run's output_dir is "in use", not "an earlier run's"
        refuse_if_in_use(cfg.output_dir)
    try:
        path, _ = fitting_checkpoint(cfg, world_size, shapes)
    except BaseException:
        if not held:  # refused: no run follows, the lock must not outlive this call (main() in a longer process)
            unlock_output_dir(cfg.output_dir, refused=True)
        raise
    if lock:
        lock_output_dir(cfg.output_dir)
    return path
