#!/usr/bin/env bash
# Make the base image locally, for hosts that cannot pull python:3.11-slim from a registry:
# Debian bookworm (Python 3.11 with venv) from the Debian mirror by debootstrap, this host's CA
# bundle (so TLS through an intercepting proxy verifies inside the containers), then
# `docker import`. Needs root, debootstrap and a running Docker engine.
#   docker/make-base-image.sh [image]        (default blitzmesh-base:bookworm)
set -euo pipefail
image="${1:-blitzmesh-base:bookworm}"
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import - "$image"
echo "built $image"
