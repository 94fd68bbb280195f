"""Make ``import torchaudio`` work beside the pinned torch 2.13.0 CPU wheel, for SpeechBrain (``distkit[speechbrain]``).

SpeechBrain imports torchaudio when it is imported (``speechbrain/utils/torch_audio_backend.py``). The newest
torchaudio on PyPI (2.11.1) is built against CUDA torch 2.11: its native libraries need ``libc10_cuda.so``, which the
CPU torch wheel does not have, so ``import torchaudio`` raises ``OSError: Could not load this library``. torchaudio
loads its native part only where the file exists (``torchaudio._extension.utils._load_lib``) and runs without it
(no compiled audio ops: none of which distkit's SpeechBrain recipes use; they read no audio files). So: when the
import fails on a native library, move those libraries aside (``lib/*.so`` -> ``lib/native-unloadable/``) and
check that the import now works. Does nothing when torchaudio is absent or imports. Exit 1 when it still fails.
"""
from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys


def _imports() -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "import torchaudio"], capture_output=True, text=True)


def main() -> int:
    spec = importlib.util.find_spec("torchaudio")
    if spec is None or spec.origin is None:
        return 0
    first = _imports()
    if first.returncode == 0:
        return 0
    if "Could not load this library" not in first.stderr:
        print(first.stderr[-2000:], file=sys.stderr)
        return 1
    lib = pathlib.Path(spec.origin).parent / "lib"
    aside = lib / "native-unloadable"
    aside.mkdir(exist_ok=True)
    for so in lib.glob("*.so"):
        so.rename(aside / so.name)
    second = _imports()
    if second.returncode != 0:
        print(second.stderr[-2000:], file=sys.stderr)
        return 1
    print(f"torchaudio: native libraries (built for CUDA torch) moved to {aside}; the Python part imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
