#!/usr/bin/env bash
# Build blitzmesh:latest, the one image of every compose service.
#   docker/build.sh                 FROM python:3.11-slim (pulled from a registry)
#   BASE_IMAGE=blitzmesh-base:bookworm docker/build.sh
#                                   FROM a base made locally (docker/make-base-image.sh)
# A torch CPU wheel found in $WHEELS (default /opt/wheels) is copied into the build context
# (docker/wheels/, not tracked) so the image installs torch==2.13.0 without CUDA packages;
# without one, pip takes torch from TORCH_INDEX_URL or the default index.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels="${WHEELS:-/opt/wheels}"
rm -f docker/wheels/*.whl
if compgen -G "$wheels/torch-2.13.0+cpu-*.whl" > /dev/null; then
  cp "$wheels"/torch-2.13.0+cpu-*.whl docker/wheels/
fi
args=()
[ -n "${BASE_IMAGE:-}" ] && args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
[ -n "${TORCH_INDEX_URL:-}" ] && args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
DOCKER_BUILDKIT=0 docker build "${args[@]}" -t blitzmesh:latest .
