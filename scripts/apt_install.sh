#!/usr/bin/env bash
# Install Debian packages for a test set-up script, as root with apt-get (the machines of this
# project: Debian 12, as root); runs `apt-get update` only when the install fails without it.
#
#   scripts/apt_install.sh CALLER PACKAGE...
#
# CALLER names the script in the error shown where root or apt-get is missing.
set -euo pipefail
caller=$1; shift
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "$caller: needs root and apt-get to install $*; install them with your system's package manager" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends "$@" >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "$@" >/dev/null; }
