#!/usr/bin/env bash
# Install everything the test suite needs, then run it. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

# Mooncake's transfer engine links against Debian's libibverbs1, even over TCP.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1
fi

# Pin torch first: the CPU build is on this machine's disk; an unpinned torch pulls a CUDA build.
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check -e '.[real,test,silicon,ray]'

# The slowest tests are listed so the 30-minute budget can be watched.
python -m pytest -q --durations=25 "$@"
