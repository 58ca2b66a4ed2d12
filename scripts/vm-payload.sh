#!/usr/bin/env bash
# The tiny bootable payload the KVM provider's tests boot, into DIR (default
# target/vm-payload): Debian's kernel (vmlinuz, from the linux-image-amd64
# package, unpacked, not installed) and an initramfs of busybox-static whose
# init prints a marker line with what the VM was given, then stays up.
# Also writes DIR/accel: `kvm` if a VM really boots under KVM here, else `tcg`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/vm-payload}
mkdir -p "$out"
out=$(cd "$out" && pwd)

# Load order matters: each needs the ones before it.
modules="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci failover net_failover virtio_net"
if [ ! -s "$out/vmlinuz" ] || [ ! -s "$out/modules/virtio_net.ko" ]; then
    package=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/ {print $2; exit}')
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    (cd "$work" && apt-get download -qq -o APT::Sandbox::User=root "$package")
    dpkg-deb --fsys-tarfile "$work"/*.deb | tar -x -C "$work" --wildcards './boot/vmlinuz-*' '*/virtio*.ko' '*/failover.ko' '*/net_failover.ko'
    mkdir -p "$out/modules"
    for m in $modules; do find "$work/lib/modules" -name "$m.ko" -exec cp {} "$out/modules/" \; ; done
    cp "$work"/boot/vmlinuz-* "$out/vmlinuz.tmp" && mv "$out/vmlinuz.tmp" "$out/vmlinuz"
    echo "vm-payload: kernel from $package"
fi

root=$(mktemp -d)
mkdir -p "$root/bin" "$root/proc" "$root/sys" "$root/dev" "$root/modules"
cp /bin/busybox "$root/bin/busybox"
for m in $modules; do cp "$out/modules/$m.ko" "$root/modules/"; done
cat > "$root/init" <<INIT
#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
for m in $modules; do /bin/busybox insmod /modules/\$m.ko; done
mem=\$(/bin/busybox awk '/MemTotal/ {print \$2}' /proc/meminfo)
mac=\$(/bin/busybox cat /sys/class/net/eth0/address 2>/dev/null || echo none)
echo "BROKER-VM-UP mem_kb=\$mem cpus=\$(/bin/busybox nproc) mac=\$mac"
while true; do /bin/busybox sleep 3600; done
INIT
chmod 755 "$root/init"
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -1 > "$out/initrd.gz.tmp")
mv "$out/initrd.gz.tmp" "$out/initrd.gz"
rm -rf "$root"

# /dev/kvm can exist and open while guests never get going (nested
# virtualisation without the features a kernel wants): boot once to see.
accel=tcg
if [ -r /dev/kvm ]; then
    console=$(mktemp)
    qemu-system-x86_64 -accel kvm -cpu host -m 256 -nodefaults -no-user-config -display none \
        -kernel "$out/vmlinuz" -initrd "$out/initrd.gz" -append "console=ttyS0 quiet" \
        -serial "file:$console" >/dev/null 2>&1 &
    probe=$!
    for _ in $(seq 100); do
        if grep -q BROKER-VM-UP "$console"; then accel=kvm; break; fi
        sleep 0.2
    done
    kill -KILL "$probe" 2>/dev/null || true
    wait "$probe" 2>/dev/null || true
    rm -f "$console"
fi
echo "$accel" > "$out/accel"
echo "vm-payload: $out (accel: $accel)"
