#!/usr/bin/env bash
# Debian packages the test suite needs beyond Python: Chromium for the dashboard's browser test, etcd
# (etcd-server) for the etcd client's tests on a 3-member loopback cluster, iproute2 (`ip netns`) for the
# deployment-over-hosts tests' network namespaces.
# Installed when missing and this user may (root, or sudo without a password); otherwise said, and the
# browser test skips with its reason. Idempotent: nothing to do when they are there.
set -euo pipefail
want=()
command -v chromium >/dev/null 2>&1 || want+=(chromium)
command -v etcd >/dev/null 2>&1 || want+=(etcd-server)
command -v ip >/dev/null 2>&1 || want+=(iproute2)
[ ${#want[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ]; then
    as=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as=(sudo -n)
else
    echo "system_packages: cannot install ${want[*]} (not root, no sudo): the tests needing them will skip" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "system_packages: no apt-get here; install ${want[*]} by hand for the tests needing them" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
"${as[@]}" apt-get update -qq
"${as[@]}" apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
echo "system_packages: installed ${want[*]}"
