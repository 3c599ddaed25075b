#!/usr/bin/env bash
# Build the base image of deploy/container/Containerfile from Debian's own packages, with
# debootstrap (no image registry involved): Debian 12 (bookworm), minimal, plus Python 3.11.
#
#   sudo deploy/container/build-base.sh [TAG]      # default TAG: localhost/diloco-base:bookworm
#
# Needs root, debootstrap and podman (apt-get install debootstrap podman) and a Debian mirror
# (DEBIAN_MIRROR, default http://deb.debian.org/debian).
set -euo pipefail
tag=${1:-localhost/diloco-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
[ "$(id -u)" = 0 ] || { echo "$0: run as root (debootstrap)" >&2; exit 1; }
root=$(mktemp -d /var/tmp/diloco-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root" "$mirror"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | podman import --change 'CMD ["/bin/bash"]' - "$tag"
echo "$tag"
