#!/usr/bin/env bash
# Install a real SLURM (Debian's slurm 22.05: slurmctld, slurmd, the client commands) and munge,
# for tests/test_slurm.py, which starts its own daemons with a test-owned config (tests/slurm.py).
#
#   scripts/install_slurm.sh
#
# Idempotent: does nothing when slurmctld, slurmd and srun are already there. Needs root and
# apt (the machines of this project: Debian 12, as root); about 15 s.
set -euo pipefail
if command -v srun >/dev/null && [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "scripts/install_slurm.sh: needs root and apt-get to install slurmctld, slurmd, slurm-client and munge;" \
         "install them with your system's package manager" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null; }
echo "scripts/install_slurm.sh: installed $(/usr/sbin/slurmctld -V)"
