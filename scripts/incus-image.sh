#!/usr/bin/env bash
# A tiny Incus/LXD container image from Debian's busybox-static: a unified
# tarball (metadata.yaml + rootfs/) that `incus image import` takes offline.
# Usage: scripts/incus-image.sh OUT_DIR   (writes OUT_DIR/busybox.tar.gz)
set -euo pipefail
out=${1:?usage: incus-image.sh OUT_DIR}
mkdir -p "$out"
if [ -s "$out/busybox.tar.gz" ] && [ "$out/busybox.tar.gz" -nt /bin/busybox ]; then
    echo "incus-image: $out/busybox.tar.gz is up to date"
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
mkdir -p "$root"/{bin,sbin,etc,proc,sys,dev,tmp,root,run,var}
cp /bin/busybox "$root/bin/busybox"
for applet in sh ls cat sleep uptime ip ps free nproc hostname; do
    ln -s busybox "$root/bin/$applet"
done
ln -s ../bin/busybox "$root/sbin/init"
cat > "$work/metadata.yaml" <<META
architecture: $(uname -m)
creation_date: $(date +%s)
properties:
  description: busybox test image (wasm-broker)
  os: busybox
META
tar -C "$work" -czf "$out/busybox.tar.gz.tmp" metadata.yaml rootfs
mv "$out/busybox.tar.gz.tmp" "$out/busybox.tar.gz"
echo "incus-image: wrote $out/busybox.tar.gz"
