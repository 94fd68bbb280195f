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
"$(dirname "$0")/apt_install.sh" scripts/install_slurm.sh slurmctld slurmd slurm-client munge
echo "scripts/install_slurm.sh: installed $(/usr/sbin/slurmctld -V)"
