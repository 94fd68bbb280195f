"""Reading checkpoints: the ``latest`` pointer, the manifest and the verification of every file against it,
the choice of the checkpoint a run continues from (:func:`find_resumable`, :func:`checkpoint_for`), the
checks that it fits (:func:`check_fits`), run ids, and one rank's file (:func:`load`)."""
from __future__ import annotations

import json
import os
import uuid
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from distkit import portable
from distkit.errors import CheckpointError, ConfigError

from .paths import STEP_RE, _ASIDE_RE, _rank_file, _step_of, sha256_file

if TYPE_CHECKING:
    from distkit.config import RunConfig


def resolve(root: str, name: str) -> Optional[str]:
    """The directory of checkpoint ``name``: ``root/name``, or its aside copy ``root/.name.old`` when a
    re-save was interrupted between moving the old one aside and putting the new one in place."""
    for path in (os.path.join(root, name), os.path.join(root, f".{name}.old")):
        if os.path.isfile(os.path.join(path, "manifest.json")):
            return path
    return None


def read_latest(root: str) -> tuple[Optional[str], Optional[str]]:
    """``(name, None)``: the checkpoint name ``root/latest`` holds; ``(None, why)`` when it holds none, ``why``
    completing "checkpoints/latest ..." ("is missing", "is damaged (...)"). The pointer is a file of ours, but
    a disk error, a copy gone wrong or a user may have left anything there: bytes that are not text, another
    text, a directory; each is a damaged pointer, never an exception."""
    pointer = os.path.join(root, "latest")
    if not os.path.lexists(pointer):
        return None, "is missing"
    linked = _linked_step(root)
    if linked is not None:  # a symlink to a checkpoint directory (made by hand, or by a tool): what it names
        return linked, None
    if not os.path.isfile(pointer):
        return None, "is damaged (it is not a file)"
    try:
        with open(pointer, "rb") as f:
            data = f.read(256)  # a checkpoint name is 12 characters: more is damage too, and is not read whole
        name = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, "is damaged (it holds bytes that are not UTF-8 text, not a checkpoint name)"
    except OSError as e:
        return None, f"is damaged (it cannot be read: {e.strerror or e})"
    if not name:
        return None, "is damaged (it is empty)"
    if not STEP_RE.match(name):  # also keeps a NUL byte or a path out of os.path calls
        return None, f"is damaged (it holds {name[:40]!r}, not a checkpoint name)"
    return name, None


def _linked_step(root: str) -> Optional[str]:
    """The checkpoint name ``root/latest`` links to when it is a symlink to a checkpoint directory in ``root``."""
    pointer = os.path.join(root, "latest")
    if not (os.path.islink(pointer) and os.path.isdir(pointer)):
        return None
    target = os.path.realpath(pointer)
    name = os.path.basename(target)
    return name if STEP_RE.match(name) and os.path.dirname(target) == os.path.realpath(root) else None


def latest(root: str) -> Optional[str]:
    """The complete directory ``latest`` points to (see :func:`resolve`), or None, also when ``latest`` is
    missing or damaged (not verified: :func:`find_resumable` is what a resume uses)."""
    name, _ = read_latest(root)
    return resolve(root, name) if name else None


def read_manifest(path: str) -> dict[str, Any]:
    manifest_path = os.path.join(path, "manifest.json")
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"'{path}' is not a complete distkit checkpoint (no manifest.json): pick another "
                              "or use ++resume auto")
    try:
        with open(manifest_path) as f:
            manifest: dict[str, Any] = json.load(f)
        manifest["world_size"], manifest["files"]  # noqa: B018 (the keys every version has)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint '{path}' is damaged: {manifest_path} cannot be read ({e})") from e
    wrong = _manifest_problem(manifest)
    if wrong:  # an edited or damaged manifest: one line here, not a TypeError wherever a value is used
        raise CheckpointError(f"checkpoint '{path}' is damaged: {manifest_path} {wrong}: restore it, or resume from "
                              "another checkpoint")
    return manifest


def _manifest_problem(m: Any) -> Optional[str]:
    """What is wrong with the structure of a manifest's values (None: every value has the type distkit writes)."""
    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    if not isinstance(m, dict):
        return "is not a JSON object"
    if not count(m["world_size"]) or m["world_size"] < 1:
        return f"has world_size {m['world_size']!r}, not a number of ranks"
    if not isinstance(m["files"], dict):
        return "has 'files' that is not an object of file entries"
    for rel, want in m["files"].items():
        ok = count(want) or (isinstance(want, dict) and count(want.get("size"))
                             and isinstance(want.get("sha256", ""), str))
        if not ok or os.path.isabs(rel) or ".." in rel.split("/"):
            return f"has a file entry {rel[:60]!r}: {str(want)[:60]!r} that is not a size and sha256 under the checkpoint"
    shapes = m.get("shapes")
    if shapes is not None and not (isinstance(shapes, dict) and all(
            isinstance(v, list) and all(count(d) for d in v) for v in shapes.values())):
        return "has 'shapes' that are not lists of tensor sizes"
    return None


def _check_file(path: str, rel: str, want: Any) -> Optional[str]:
    """What is wrong with file ``rel`` of checkpoint ``path`` (None: it matches the manifest)."""
    full = os.path.join(path, rel)
    if not os.path.isfile(full):
        return f"{full} is missing"
    size = want if isinstance(want, int) else want["size"]  # format 1 recorded sizes only
    if os.path.getsize(full) != size:
        return f"{full} has {os.path.getsize(full)} bytes, the manifest says {size}"
    if isinstance(want, dict) and want.get("sha256"):
        stat = os.stat(full)
        key = (os.path.abspath(full), stat.st_size, stat.st_mtime_ns, want["sha256"])
        if key in _HASHED or _trusted(path):  # hashed once per process; or by the launching command just now
            return None
        if sha256_file(full) != want["sha256"]:
            return f"{full} does not match its sha256 in the manifest"
        _HASHED.add(key)
    return None


#: files whose sha256 this process has checked (path, size, mtime, digest): a resume verifies once
_HASHED: set[tuple[str, int, int, str]] = set()
#: set by the launching command for the ranks it starts: the checkpoint its preflight verified
TRUSTED_ENV = "DISTKIT_VERIFIED_CHECKPOINT"


def _trusted(path: str) -> bool:
    return os.environ.get(TRUSTED_ENV) == os.path.abspath(path)


def exists(path: str) -> bool:
    """Whether ``path`` holds a complete distkit checkpoint: a directory with its manifest and every file the
    manifest lists, at the recorded size. A checkpoint is a directory, so the habit ``os.path.isfile(args.resume)``
    of a one-file checkpoint says False and a script would start over: use this instead. Cheap (sizes, no
    hashing; :meth:`distkit.Session.load` verifies every sha256 before it restores anything). Not collective."""
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        return False
    return all(_check_file(path, rel, want["size"] if isinstance(want, dict) else want) is None
               for rel, want in manifest["files"].items())


def _edited(path: str, manifest: dict[str, Any]) -> Optional[str]:
    """What makes ``manifest`` (read by :func:`read_manifest`, which refuses names outside the checkpoint) one no
    distkit wrote (None: nothing): a file reached through a symbolic link, or a file every checkpoint of its kind has
    left out of the map (a rank file, the portable part's metadata), which the sizes and hashes of the files it does
    list cannot reveal."""
    files = manifest["files"]
    for rel in files:
        parts = rel.split("/")
        if any(os.path.islink(os.path.join(path, *parts[:i + 1])) for i in range(len(parts))):
            return f"{os.path.join(path, rel)} is a symbolic link (a checkpoint holds its own files)"
    need = [] if manifest.get("engine") == "portable" else [_rank_file(r) for r in range(int(manifest.get("world_size") or 0))]
    if manifest.get("portable"):
        need.append(f"{portable.DIR}/.metadata")
    missing = [n for n in need if n not in files]
    if missing:
        return (f"{os.path.join(path, 'manifest.json')} lists no {missing[0]}, which every checkpoint of "
                f"{manifest.get('world_size')} rank(s) has: the manifest was edited")
    return None


def verify(path: str, only: Optional[str] = None, under: Optional[str] = None) -> Optional[str]:
    """What is damaged in checkpoint ``path`` (the first file, by name), or None when every file (or
    just file ``only``, or the files in its subdirectory ``under``) has the size and sha256 its
    manifest records."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return str(e)
    problem = _edited(path, manifest)
    if problem:
        return problem
    for rel, want in sorted(manifest["files"].items()):
        if (only is None or rel == only) and (under is None or rel.startswith(under + os.sep)):
            problem = _check_file(path, rel, want)
            if problem:
                return problem
    return None


def find_resumable(root: str, doing: str = "resuming from") -> tuple[Optional[str], list[str]]:
    """For ``++resume auto``: the newest verified complete checkpoint under ``root`` and notes on why it is
    not the one ``latest`` names (``latest`` missing, damaged, naming an unusable checkpoint, or an older one:
    a save whose ``latest`` update failed or was killed leaves a newer complete checkpoint, the one to
    continue from). ``doing`` words the notes ("resuming from", "inspecting"). (None, []) when there is no
    checkpoint at all. Raises :class:`CheckpointError` naming the damaged file when checkpoints exist but
    none is complete: a resume never silently starts from step 0 over an earlier run."""
    if not os.path.isdir(root):
        return None, []
    entries = os.listdir(root)
    names = {e for e in entries if STEP_RE.match(e)} | {m.group(1) for e in entries if (m := _ASIDE_RE.match(e))}
    named, pointer_problem = read_latest(root)
    if not names and named is None and pointer_problem == "is missing":
        return None, []
    order = sorted(names, key=_step_of, reverse=True)  # newest first, whatever `latest` says
    problems: dict[str, str] = {}
    if named is not None and named not in names:  # (neither the directory nor its aside copy is there)
        problems[named] = f"{os.path.join(root, named)} does not exist"
    for name in order:
        path = resolve(root, name)
        problem = verify(path) if path else (
            f"{os.path.join(root, name)} has no manifest.json (an interrupted save)" if os.path.isdir(os.path.join(root, name))
            else f"{os.path.join(root, name)} does not exist")
        if problem is not None:
            problems[name] = problem
            continue
        if name == named:
            return path, []
        if named is None:
            why = pointer_problem
        elif named in problems:
            why = f"names {named}, which is unusable: {problems[named]}"
        else:  # an older checkpoint (not verified: a newer complete one is there)
            why = f"names {named}, but {name} is newer and complete"
        return path, [f"checkpoints/latest {why}; {doing} {name}, the newest complete checkpoint"]
    first_problem = next(iter(problems.values()), f"checkpoints/latest {pointer_problem}")
    raise CheckpointError(f"no complete checkpoint in {root} to resume from: {first_problem}; restore the file, "
                          "resume from a checkpoint directory with ++resume DIR, or start over with ++resume none")


def check_layout(output_dir: str) -> None:
    """ConfigError unless ``output_dir/checkpoints`` is a directory (or absent) and its ``latest`` a file (or
    absent): anything else would only fail at the first save, after training (and after the run's
    metrics.jsonl was started over). Reads only."""
    root = os.path.join(output_dir, "checkpoints")
    if os.path.lexists(root) and not os.path.isdir(root):
        raise ConfigError(f"'{root}' is a file, where distkit keeps the run's checkpoint directory: move or delete it, "
                          "or choose another output_dir")
    pointer = os.path.join(root, "latest")
    if os.path.isdir(pointer) and _linked_step(root) is None:
        raise ConfigError(f"'{pointer}' is a directory, where distkit keeps the file naming the newest checkpoint: "
                          "move or delete it (++resume auto then finds the newest complete checkpoint), or choose "
                          "another output_dir")


def checkpoint_for(cfg: "RunConfig") -> tuple[Optional[str], list[str]]:
    """The checkpoint ``cfg.resume`` asks for, verified, and notes for the user (see :func:`find_resumable`).
    First :func:`check_layout`, whatever ``resume`` is: every run saves into ``checkpoints/``."""
    check_layout(cfg.output_dir)
    if cfg.resume == "auto":
        return find_resumable(os.path.join(cfg.output_dir, "checkpoints"))
    if cfg.resume is None:  # unset: an earlier run's checkpoints are never replaced without being asked
        root = os.path.join(cfg.output_dir, "checkpoints")
        steps = sorted((e for e in os.listdir(root) if STEP_RE.match(e)), key=_step_of) if os.path.isdir(root) else []
        if steps:
            raise ConfigError(f"output_dir '{cfg.output_dir}' holds checkpoints of an earlier run (newest: {steps[-1]}): "
                              "continue it with ++resume auto, start over with ++resume none (its checkpoints are "
                              "then replaced), or choose another output_dir")
        return None, []
    if cfg.resume == "none":
        return None, []
    path = cfg.resume if os.path.isfile(os.path.join(cfg.resume, "manifest.json")) else \
        resolve(os.path.dirname(os.path.abspath(cfg.resume)), os.path.basename(os.path.abspath(cfg.resume)))
    problem = verify(path or cfg.resume)
    if problem:
        raise CheckpointError(f"cannot resume from '{cfg.resume}': {problem}")
    return path, []


def fitting_checkpoint(cfg: "RunConfig", world_size: int,
                       shapes: Optional[Callable[[], Optional[dict[str, list[int]]]]] = None) -> tuple[Optional[str], list[str]]:
    """:func:`checkpoint_for`, then :func:`check_fits`. Under ``++resume auto``, a newest complete checkpoint that
    does not fit (a stray one of another model or layout, newer than what ``latest`` names) gives way to the
    verified checkpoint ``latest`` names, if that one fits; the note says what was skipped and why. Raises the
    first checkpoint's error when neither fits."""
    path, notes = checkpoint_for(cfg)
    if path is None:
        return path, notes
    try:
        check_fits(path, world_size, shapes)
        return path, notes
    except ConfigError as e:
        if cfg.resume != "auto":
            raise
        root = os.path.join(cfg.output_dir, "checkpoints")
        named, _ = read_latest(root)
        other = resolve(root, named) if named else None
        if other is None or os.path.abspath(other) == os.path.abspath(path) or verify(other) is not None:
            raise
        try:
            check_fits(other, world_size, shapes)
        except ConfigError:
            raise e from None
        return other, [f"skipped {os.path.basename(path)}, a newer checkpoint than checkpoints/latest that does not "
                       f"fit this run ({str(e).split(': ', 1)[-1]}); resuming from {named}, which latest names"]


def new_run_id() -> str:
    """A fresh run id: 12 hex digits (48 random bits)."""
    return uuid.uuid4().hex[:12]


def recorded_run_id(output_dir: str) -> Optional[str]:
    """The run id an earlier run recorded in ``output_dir/config.resolved.json`` (None: none there, or
    unreadable). A run that continues from its own checkpoints keeps it, so it names the output_dir's run."""
    try:
        with open(os.path.join(output_dir, "config.resolved.json"), encoding="utf-8") as f:
            value = json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def run_id_note(path: str, run_id: str) -> Optional[str]:
    """A note when checkpoint ``path`` was written by another run than ``run_id`` (its manifest records
    the writer's id; checkpoints older than run ids record none and are not questioned)."""
    theirs = read_manifest(path).get("run_id")
    if not theirs or theirs == run_id:
        return None
    return (f"{os.path.basename(os.path.normpath(path))} was written by another run (run id {theirs}; this "
            f"output_dir's run is {run_id}): continuing from it; if it was copied here by mistake, stop and "
            "remove it, or resume from the intended checkpoint with ++resume PATH")


def check_fits(path: str, world_size: int, shapes: Optional[Callable[[], Optional[dict[str, list[int]]]]] = None) -> None:
    """ConfigError unless checkpoint ``path`` can be loaded by ``world_size`` ranks into a model whose
    tensor shapes ``shapes()`` returns (None: not checked)."""
    manifest = read_manifest(path)
    if manifest["world_size"] != world_size and not manifest.get("portable"):
        n = manifest["world_size"]
        ranks = f"{n} rank" + ("s" if n != 1 else "")
        raise ConfigError(
            f"checkpoint '{path}' was written by {ranks}, this run has {world_size}: resume with {ranks} (it predates "
            f"portable checkpoints, which resume on any number of ranks), or take its weights to a fresh run with `distkit export "
            f"{path} model.pt`")
    saved = manifest.get("shapes")
    mine = shapes() if (saved and shapes is not None) else None
    if not saved or mine is None:
        return
    for name, shape in saved.items():
        if name in mine and list(mine[name]) != list(shape):
            raise ConfigError(f"checkpoint '{path}' does not fit the model: parameter '{name}' has shape "
                              f"{list(shape)} in the checkpoint and {list(mine[name])} in the model; resume with the "
                              "model that wrote it, or start over with ++resume none")
    missing = [n for n in saved if n not in mine]
    if missing:
        raise ConfigError(f"checkpoint '{path}' does not fit the model: it has parameter '{missing[0]}', which the "
                          "model lacks; resume with the model that wrote it, or start over with ++resume none")


def model_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """Shapes of a model's state_dict tensors (ZeRO-3 partitioned parameters: their full ``ds_shape``)."""
    full = {n: getattr(p, "ds_shape", None) for n, p in model.named_parameters(remove_duplicate=False)}
    return {k: list(full.get(k) or v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def read_rank_file(path: str, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's state from a complete checkpoint directory (not collective); its file is verified
    against the manifest (size and sha256) first."""
    manifest = read_manifest(path)
    if manifest["world_size"] != world_size:
        check_fits(path, world_size)
    problem = verify(path, only=_rank_file(rank))
    if problem:
        raise CheckpointError(f"checkpoint '{path}' is damaged: {problem}; resume from another checkpoint "
                              "(++resume auto falls back to the newest complete one)")
    return portable.load_file(os.path.join(path, _rank_file(rank)))  # type: ignore[no-any-return]
