"""torchft's lighthouse, started without importing the torchft package.

``torchft_lighthouse`` (torchft's own script) imports ``torchft``, whose ``__init__`` imports torch: about
1.6 s on these machines before the lighthouse binds its port, for a server that uses no torch at all. The
lighthouse is ``lighthouse_main`` of torchft's Rust extension ``torchft._torchft``; this file loads that
extension alone and calls it. :mod:`distkit.commands.lighthouse` runs it as a script,
``python .../distkit/ft/lighthouse.py --bind ... --min_replicas ...``: the lighthouse parses the process's own
argv and skips only its first word (the interpreter), so the second must be this script's path (``python
-c`` or ``-m`` would put another word there). Standard library only: the script's folder (``distkit/ft/``) is
first on ``sys.path`` and is taken off before any import could find a distkit module there by its short
name.
"""
import os  # distkit/ft/ holds no os.py or sys.py: these two are safe before the fix below
import sys

if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # distkit/ft/ itself (not with -P/PYTHONSAFEPATH): its state.py, watch.py must not stand in for anything

import importlib.machinery
import importlib.util
from typing import Optional

#: how to get torchft (distkit.ft.groups's errors say it too)
INSTALL_HINT = "pip install 'distkit[ft]' (torchft)"


def extension_path() -> Optional[str]:
    """The file of torchft's extension module ``torchft._torchft`` (None: torchft is not installed). Finds
    the package's folder without running its ``__init__``."""
    spec = importlib.util.find_spec("torchft")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(folder, "_torchft" + suffix)
            if os.path.isfile(path):
                return path
    return None


def main() -> int:
    path = extension_path()
    if path is None:
        print(f"distkit: error: torchft is not installed: {INSTALL_HINT}", file=sys.stderr)
        return 2
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", path)
    spec = importlib.util.spec_from_file_location("torchft._torchft", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return int(module.lighthouse_main() or 0)


if __name__ == "__main__":
    sys.exit(main())
