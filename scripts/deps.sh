#!/usr/bin/env bash
# Checks the Rust toolchain and installs the Debian packages the daemon's tests and
# examples drive (real clients and the emulated SAN). Idempotent: does nothing when all is there.
set -euo pipefail

if ! command -v cargo >/dev/null 2>&1; then
    echo "deps: cargo not found. Install Rust with rustup (https://rustup.rs); the pinned" >&2
    echo "      toolchain is in rust-toolchain.toml." >&2
    exit 1
fi

pkgs=(nbdkit libnbd-bin python3-libnbd fio qemu-utils)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "deps: missing packages ${missing[*]} and no apt-get to install them; install them by hand." >&2
    exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
        echo "deps: missing packages ${missing[*]}; run as root or install them: apt-get install ${missing[*]}" >&2
        exit 1
    fi
fi
echo "deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
if ! $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
