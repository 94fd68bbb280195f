#!/usr/bin/env bash
# Install pdsh and the OpenSSH server, for DeepSpeed's default launcher (pdsh over ssh) across hosts
# in tests/test_multihost.py, which starts its own sshd inside each test host with a test-owned key
# and config (tests/hosts.py, Hosts.sshd). No sshd service is started or enabled for this machine.
#
#   scripts/install_pdsh.sh
#
# Idempotent: does nothing when pdsh and sshd are already there. Needs root and apt (the machines
# of this project: Debian 12, as root); about 10 s.
set -euo pipefail
if command -v pdsh >/dev/null && [ -x /usr/sbin/sshd ] && command -v ssh-keygen >/dev/null; then
    exit 0
fi
"$(dirname "$0")/apt_install.sh" scripts/install_pdsh.sh pdsh openssh-server openssh-client
echo "scripts/install_pdsh.sh: installed $(pdsh -V 2>&1 | head -1), $(ssh -V 2>&1)"
