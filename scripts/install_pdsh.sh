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
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "scripts/install_pdsh.sh: needs root and apt-get to install pdsh and openssh-server;" \
         "install them with your system's package manager" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
pkgs=(pdsh openssh-server openssh-client)
apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null; }
echo "scripts/install_pdsh.sh: installed $(pdsh -V 2>&1 | head -1), $(ssh -V 2>&1)"
