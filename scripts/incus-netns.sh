#!/bin/sh
# Run by the LXD tests as `unshare --mount --net sh scripts/incus-netns.sh BRIDGE`
# with INCUS_DIR set: gives incusd a network namespace of its own (so the
# test's bridge and the containers' veths never touch the host's network)
# and execs it, so the pid the test holds is incusd's.
#
# A new network namespace needs its own /sys for incusd to see its devices;
# mounting one hides the cgroup hierarchies under /sys/fs/cgroup, so they are
# mounted again exactly as the host has them (same hierarchies, same options).
set -eu
bridge=$1
cgroups=$(awk '$2 ~ "^/sys/fs/cgroup" { print $3, $2, $4 }' /proc/self/mounts)
mount --make-rprivate /
mount -t sysfs sysfs /sys
echo "$cgroups" | while read -r type point options; do
    case $type in
        tmpfs) mount -t tmpfs -o "$options" tmpfs "$point" ;;
        cgroup | cgroup2) mkdir -p "$point" && mount -t "$type" -o "$options" "$type" "$point" ;;
    esac
done
ip link set lo up
ip link add "$bridge" type bridge
ip link set "$bridge" up
exec /usr/libexec/incus/incusd --group root
