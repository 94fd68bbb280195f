"""Reading config files (Python, YAML, JSON) and ``++key value`` overrides into one raw dict.

Precedence: defaults < files (in the order given; a later file wins) < command line.
A Python config is executed like RETURNN's: its top-level globals are the keys; names
starting with "_", imported modules, imported classes and functions, and functions/classes
defined in the config that are not keys are helpers and are ignored (unless a helper defined
in the config has a near-miss of a key as its name, which is an error). Any other global that
is not a key (a constant such as ``VOCAB = 65``) is an error that says to prefix it with "_".
"""
from __future__ import annotations

import __future__
import ast
import difflib
import json
import os
import traceback
import types
from typing import Any, Iterable, Mapping

from distkit.errors import ConfigError

from .schema import ALL_KEYS


def nearest_key(key: str, known: Iterable[str] = ALL_KEYS) -> str | None:
    """The closest known key to ``key`` (difflib ratio >= 0.6), or None."""
    match = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return match[0] if match else None


def unknown_key_error(key: str, known: Iterable[str] = ALL_KEYS, where: str = "config") -> ConfigError:
    """``unknown <where> key '<key>'`` with the nearest known key as the fix, or where to find the keys."""
    near = nearest_key(key, known)
    hint = f"did you mean '{near}'?" if near else "see `distkit train --help` for the known keys"
    return ConfigError(f"unknown {where} key '{key}': {hint}")


def python_unknown_key_error(name: str, path: str) -> ConfigError:
    """An unknown top-level name in the Python config ``path``: the nearest known key, and the rule for
    helpers. Every global of a Python config is a key unless it starts with "_" (or is a module, an import
    or a function/class defined there), so a constant a helper uses (``VOCAB = 65``) reads as a misspelt
    key; the message says how to keep it as a helper."""
    helper = f"a helper name in a Python config must start with '_' (_{name}) to be ignored"
    near = nearest_key(name)
    if near is not None:
        return ConfigError(f"unknown config key '{name}' in {path}: did you mean '{near}'? If it is a helper, its "
                           f"name must start with '_' (_{name}) to be ignored in a Python config")
    return ConfigError(f"unknown config key '{name}' in {path}: {helper} (`distkit keys` lists the keys)")


def not_a_file(path: str) -> str | None:
    """Why ``path`` is no regular file to read ("does not exist", "is a directory", "is a symlink loop", ...), or
    None when it is one."""
    import errno
    import stat

    if os.path.isfile(path):
        return None
    if not os.path.lexists(path):
        return "does not exist"
    try:
        mode = os.stat(path).st_mode
    except OSError as e:  # ELOOP, a dangling link, no permission on a directory above
        return ("is a symlink loop" if e.errno == errno.ELOOP else "is a symlink to nothing" if os.path.islink(path)
                else f"cannot be read ({e.strerror})")
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]
    return "is " + next((what for test, what in kinds if test(mode)), "not a regular file") + ", not a file"


def load_file(path: str) -> dict[str, Any]:
    """Load one config file into a dict of raw (unvalidated) top-level keys."""
    why = not_a_file(path)
    if why is not None:
        where = f" (relative to {os.getcwd()})" if why == "does not exist" else ""
        raise ConfigError(f"config file '{path}' {why}: check the path{where}")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".py" or ext == ".config":
        return _load_python(path)
    if ext in (".yaml", ".yml"):
        return _load_yaml(path)
    if ext == ".json":
        return _load_json(path)
    raise ConfigError(f"config file '{path}': unknown extension '{ext}': use .py, .yaml, .yml or .json")


def read_text(path: str) -> str:
    """The text of the config file ``path``, which must be UTF-8 (what Python, YAML and JSON configs are
    read as): ConfigError naming the file and the first bad byte otherwise, not a UnicodeDecodeError
    traceback (a file saved as Latin-1 or UTF-16, or a binary file given by mistake)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: the config file is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                          f"{e.start}): save it as UTF-8") from None


def _load_python(path: str) -> dict[str, Any]:
    source = read_text(path)
    try:
        code = compile(source, path, "exec")
    except SyntaxError as e:
        raise ConfigError(f"{path}:{e.lineno}: syntax error in config: {e.msg}: fix the Python syntax") from None
    if not ast.parse(source).body:
        # 0 bytes (or only comments): trained every default into runs/default before, never what was meant
        raise ConfigError(f"config file '{path}' is empty (no keys): write the keys in it (`distkit keys` lists "
                          "them), or task = 'digits' for the defaults")
    namespace: dict[str, Any] = {"__file__": os.path.abspath(path), "__name__": "__distkit_config__"}
    try:
        exec(code, namespace)  # noqa: S102 - a config file is code by design (RETURNN)
    except Exception as e:  # any error while executing the user's config is a config error
        frames = [fr for fr in traceback.extract_tb(e.__traceback__) if fr.filename == path]
        line = frames[-1].lineno if frames else "?"
        raise ConfigError(f"{path}:{line}: error while executing config: {type(e).__name__}: {e}") from None
    except SystemExit as e:
        # sys.exit() / exit() in a config would end distkit silently, with that status (0: "success",
        # having trained nothing); KeyboardInterrupt still propagates
        frames = [fr for fr in traceback.extract_tb(e.__traceback__) if fr.filename == path]
        line = frames[-1].lineno if frames else "?"
        raise ConfigError(f"{path}:{line}: the config file called sys.exit({'' if e.code is None else repr(e.code)}): "
                          "a config file must only define keys; remove the call") from None
    out: dict[str, Any] = {}
    for name, value in namespace.items():
        if name.startswith("_") or isinstance(value, (types.ModuleType, type(__future__.annotations))):
            continue  # `from __future__ import annotations` binds a _Feature: a compiler switch, not a key
        if name not in ALL_KEYS and (isinstance(value, type) or callable(value)):
            if getattr(value, "__module__", None) != namespace["__name__"]:
                continue  # imported (from torch.utils.data import Dataset): a name, not a key
            # A helper function/class of the config. A near-miss of a key is almost surely a typo.
            near = nearest_key(name)
            if near is not None and difflib.SequenceMatcher(None, name, near).ratio() >= 0.8:
                raise python_unknown_key_error(name, path)
            continue
        if name not in ALL_KEYS:
            # Refused here rather than in resolve(), which no longer knows that the name came from a
            # Python file, where the likely cause is a helper constant without the "_" prefix.
            raise python_unknown_key_error(name, path)
        out[name] = value
    return out


def _load_yaml(path: str) -> dict[str, Any]:
    import yaml

    text = read_text(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', e)}: fix the YAML syntax (no !tags)") from None
    if data is None:
        # an empty file (or only comments) parses as null: training the defaults instead is never what was meant
        raise ConfigError(f"config file '{path}' is empty (no keys): write the keys in it (`distkit keys` lists "
                          "them), or '{}' for the defaults")
    return _mapping_or_error(data, path)


def _load_json(path: str) -> dict[str, Any]:
    text = read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    return _mapping_or_error(data, path)


def _mapping_or_error(data: Any, path: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, got {type(data).__name__}")
    return dict(data)


def parse_value(text: str) -> Any:
    """RETURNN's rule for ``++key value``: a Python literal if it parses as one, else JSON (``true``,
    ``null``: what a shell user writes for ``'{"require_horovod": true}'``), else the string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pass
    try:
        return json.loads(text)
    except ValueError:
        return text


def split_overrides(argv: list[str]) -> tuple[list[str], list[tuple[str, Any]]]:
    """Take ``++key value`` and ``++key=value`` pairs out of ``argv``.

    Returns the remaining arguments and the (key, parsed value) pairs in order.
    """
    rest: list[str] = []
    pairs: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("++"):
            key = tok[2:]
            if "=" in key:
                key, raw = key.split("=", 1)
            elif i + 1 < len(argv):
                raw = argv[i + 1]
                i += 1
            else:
                raise ConfigError(f"'{tok}' has no value: write '{tok} VALUE'")
            if not key:
                raise ConfigError("'++' without a key name: write '++key value'")
            pairs.append((key, parse_value(raw)))
        else:
            rest.append(tok)
        i += 1
    return rest, pairs


def apply_override(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` (dotted for nested dicts, e.g. ``distributed.reduce_type``) in ``raw``."""
    parts = key.split(".")
    target = raw
    for part in parts[:-1]:
        child = target.get(part)
        if child is None:
            child = {}
            target[part] = child
        if not isinstance(child, dict):
            raise ConfigError(f"++{key}: '{part}' is not a dict, cannot set a sub-key in it")
        target = child
    target[parts[-1]] = value


def load_raw(paths: list[str], overrides: list[tuple[str, Any]]) -> dict[str, Any]:
    """Files in order, then overrides: the raw dict before resolution."""
    raw: dict[str, Any] = {}
    for path in paths:
        raw.update(load_file(path))
    for key, value in overrides:
        top = key.split(".", 1)[0]
        if top not in ALL_KEYS:
            raise unknown_key_error(top, where="command-line (++)")
        apply_override(raw, key, value)
    return raw
