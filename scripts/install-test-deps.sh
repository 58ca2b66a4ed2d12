#!/usr/bin/env bash
# System packages the real-system tests use (and curl, for the README's daemon examples), from Debian (this runs as root on
# bookworm). qemu comes from bookworm-backports, like the machine's qemu-utils:
# installing bookworm's older qemu-system-x86 would take qemu-img away. Incus
# (the LXD tests' daemon) exists only in bookworm-backports. The
# suite is added to the machine's existing Debian source entry; no mirror
# address is written here.
set -euo pipefail

# moto (an EC2-compatible server, run by the cloud tests with signature
# checking on) in a virtual environment under target/, pinned.
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/target/moto-venv"
if ! "$venv/bin/python" -c 'import moto, boto3' 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q 'moto[server]==5.2.5'
fi

wanted=(qemu-system-x86_64:qemu-system-x86 qemu-img:qemu-utils genisoimage:genisoimage cpio:cpio busybox:busybox-static bwrap:bubblewrap curl:curl)
missing=()
for pair in "${wanted[@]}"; do
    command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
done
[ -x /usr/libexec/incus/incusd ] && command -v incus >/dev/null || missing+=(incus)
command -v unshare >/dev/null && command -v ip >/dev/null || missing+=(util-linux iproute2)
# busybox-static specifically: the initramfs needs the static binary.
[ -x /bin/busybox ] && ldd /bin/busybox 2>&1 | grep -q "not a dynamic" || missing+=(busybox-static)
if [ ${#missing[@]} -eq 0 ]; then
    echo "install-test-deps: everything is installed"
    exit 0
fi

sources=/etc/apt/sources.list.d/debian.sources
if ! grep -q '^Suites:.*bookworm-backports' "$sources" 2>/dev/null; then
    if ! grep -q '^Suites: bookworm bookworm-updates$' "$sources" 2>/dev/null; then
        echo "install-test-deps: no 'Suites: bookworm bookworm-updates' entry in $sources to add bookworm-backports to" >&2
        exit 1
    fi
    sed -i '0,/^Suites: bookworm bookworm-updates$/s//Suites: bookworm bookworm-updates bookworm-backports/' "$sources"
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends -t bookworm-backports qemu-system-x86 qemu-utils incus
apt-get install -y -qq --no-install-recommends busybox-static genisoimage cpio util-linux mount e2fsprogs iproute2 bubblewrap curl
