#!/usr/bin/env bash
# What the system must provide, installed from Debian's packages where it is missing:
#   build  our CPU wheel's compile: a GNU C++ compiler (g++) and libnuma's headers
#          (libnuma-dev; vLLM's CPU kernels link libnuma). The build's preflight names both.
#   test   the above, and Chromium for the outlook page's test (headless).
# Usage: tools/system-deps.sh build|test. Installs nothing that is there already; as root it
# runs apt-get itself, otherwise through sudo where that works without a password, else it
# prints the one command to run and exits 1. No apt-get (not Debian): says what to install.
set -euo pipefail
what=${1:-build}
missing=()
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || missing+=(g++)
if ! printf '#include <numa.h>\n' | c++ -E -x c++ - >/dev/null 2>&1; then
    missing+=(libnuma-dev)
fi
if [ "$what" = test ] && ! command -v chromium >/dev/null 2>&1; then
    missing+=(chromium)
fi
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
echo "system-deps ($what): missing ${missing[*]}" >&2
if ! command -v apt-get >/dev/null 2>&1; then
    echo "  no apt-get here: install ${missing[*]} (a GNU C++ compiler, libnuma's headers) with" \
         "this system's package manager" >&2
    exit 1
fi
sudo=()
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo=(sudo -n)
    else
        echo "  run: sudo apt-get install --no-install-recommends ${missing[*]}" >&2
        exit 1
    fi
fi
t=$(date +%s)
"${sudo[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
echo "system-deps ($what): installed ${missing[*]} in $(( $(date +%s) - t )) s" >&2
