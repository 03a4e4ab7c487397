#!/usr/bin/env bash
# Builds the guest the VM tests boot (tests/tests/vm.rs): Debian's cloud kernel and an
# initramfs holding a static busybox, the six virtio modules a virtio-blk disk needs, and
# the init script below. The kernel package is downloaded with `apt-get download` and only
# unpacked, never installed. Idempotent: does nothing when OUT has the guest already.
#
#   tests/vm/guest.sh OUT      # writes OUT/vmlinuz and OUT/initrd.gz
#
# The tests name OUT after a hash of this file, so a changed guest is built again.
#
# The init script runs the phase named on the kernel command line (`vesta.phase=`) against
# the ext4 file system on /dev/vda, and reports on the serial console in lines that begin
# with "VESTA-VM":
#   write   writes files of random data, records their md5 sums in /mnt/sums, `sync`s, prints
#           the sums and "synced", then keeps writing more files ("extra N", with O_DIRECT
#           and no sync) until the host stops it: the IO in flight, never flushed, when the
#           test kills vestad or cuts its power.
#   verify  mounts (ext4 replays its journal), prints the sums file, checks every file
#           against it, prints "verify ok" or "verify FAILED", and powers off.
set -euo pipefail
out=$1
[ -f "$out/vmlinuz" ] && [ -f "$out/initrd.gz" ] && exit 0
for tool in busybox cpio gzip flock apt-get apt-cache dpkg-deb; do
    command -v "$tool" >/dev/null || { echo "guest.sh: $tool missing (make deps)" >&2; exit 1; }
done
# One build at a time per guest directory (test processes may start together).
mkdir -p "$(dirname "$out")"
exec 9>"$out.lock"
flock 9
[ -f "$out/vmlinuz" ] && [ -f "$out/initrd.gz" ] && exit 0
busybox_bin=$(command -v busybox)
# A dynamically linked busybox would need its libraries in the initramfs.
if ldd "$busybox_bin" >/dev/null 2>&1; then
    echo "guest.sh: $busybox_bin is not static; install busybox-static" >&2
    exit 1
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/vesta-guest.XXXXXX")
trap 'rm -rf "$work"' EXIT
# Refreshes apt's package lists, as root or through sudo when it needs no password.
apt_update() {
    if [ "$(id -u)" -eq 0 ]; then
        apt-get update -qq
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        sudo -n apt-get update -qq
    else
        echo "guest.sh: apt's package lists need a refresh; run: sudo apt-get update" >&2
        exit 1
    fi
}
# The metapackage names the current kernel package.
kernel_pkg() {
    apt-cache depends linux-image-cloud-amd64 2>/dev/null |
        awk '/Depends: linux-image-[0-9]/ { print $2; exit }'
}
download() { (cd "$work" && apt-get download -q "$1" >/dev/null 2>&1); }
pkg=$(kernel_pkg || true)
if [ -z "$pkg" ] || ! download "$pkg"; then
    # Package lists missing or stale (the version they name is gone from the mirror).
    echo "guest.sh: refreshing apt's package lists to download the guest kernel" >&2
    apt_update
    pkg=$(kernel_pkg || true)
    [ -n "$pkg" ] || { echo "guest.sh: apt knows no linux-image-cloud-amd64" >&2; exit 1; }
    download "$pkg" || { echo "guest.sh: cannot download $pkg" >&2; exit 1; }
fi
dpkg-deb -x "$work"/"$pkg"_*.deb "$work/x"
kver=${pkg#linux-image-}
moddir="$work/x/lib/modules/$kver/kernel"

root="$work/root"
mkdir -p "$root"/{bin,mod,dev,proc,sys,mnt}
cp "$busybox_bin" "$root/bin/busybox"
# In load order: each needs only the ones before it.
mods="drivers/virtio/virtio_ring drivers/virtio/virtio drivers/virtio/virtio_pci_modern_dev
      drivers/virtio/virtio_pci_legacy_dev drivers/virtio/virtio_pci drivers/block/virtio_blk"
for m in $mods; do
    f=$(ls "$moddir/$m".ko* 2>/dev/null | head -1 || true)
    case $f in
        *.ko) cp "$f" "$root/mod/" ;;
        *.ko.xz) xz -dc "$f" >"$root/mod/$(basename "$m").ko" ;;
        *.ko.zst) zstd -qdc "$f" >"$root/mod/$(basename "$m").ko" ;;
        *) echo "guest.sh: no module $m in $pkg" >&2; exit 1 ;;
    esac
done

cat >"$root/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
say() { echo "VESTA-VM $*"; }
for m in virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_blk; do
    insmod /mod/$m.ko || say "insmod $m failed"
done
for i in $(seq 50); do [ -b /dev/vda ] && break; sleep 0.1; done
phase=$(sed -n 's/.*vesta\.phase=\([a-z]*\).*/\1/p' /proc/cmdline)
say "phase $phase"
if ! mount -t ext4 /dev/vda /mnt; then
    say "mount failed"
    poweroff -f
fi
case $phase in
write)
    cd /mnt
    for i in 1 2 3 4 5 6 7 8; do
        dd if=/dev/urandom of=file$i bs=64k count=$((i * 4)) 2>/dev/null || say "write file$i failed"
    done
    md5sum file* >sums
    sync
    say "sums-begin"; cat sums; say "sums-end"
    say "synced"
    i=0
    while true; do
        i=$((i + 1))
        # O_DIRECT: each one reaches the disk at once, with no FLUSH after it.
        dd if=/dev/urandom of=extra$i bs=64k count=16 oflag=direct 2>/dev/null ||
            { say "io error"; break; }
        say "extra $i"
    done
    sleep 3600
    ;;
verify)
    cd /mnt
    say "sums-begin"; cat sums; say "sums-end"
    if md5sum -c sums; then say "verify ok"; else say "verify FAILED"; fi
    say "extra files: $(ls | grep -c extra)"
    cd /
    umount /mnt || say "umount failed"
    ;;
esac
poweroff -f
EOF
chmod +x "$root/init"
mkdir -p "$out"
# Each file appears whole or not at all, also with two builds at once.
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -1 >"$out/initrd.gz.$$")
cp "$work/x/boot/vmlinuz-$kver" "$out/vmlinuz.$$"
mv "$out/initrd.gz.$$" "$out/initrd.gz"
mv "$out/vmlinuz.$$" "$out/vmlinuz"
echo "guest.sh: guest with $pkg in $out"
