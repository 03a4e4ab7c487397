#!/usr/bin/env bash
# Checks the Rust toolchain and installs the Debian packages the daemon's tests and
# examples drive (real clients and the emulated SAN). Idempotent: does nothing when all is there.
set -euo pipefail

if ! command -v cargo >/dev/null 2>&1; then
    echo "deps: cargo not found. Install Rust with rustup (https://rustup.rs); the pinned" >&2
    echo "      toolchain is in rust-toolchain.toml." >&2
    exit 1
fi
exec "$(dirname "$0")/apt.sh" nbdkit libnbd-bin python3-libnbd fio qemu-utils etcd-server etcd-client protobuf-compiler \
    qemu-system-x86 busybox-static cpio e2fsprogs
