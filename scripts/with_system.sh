#!/usr/bin/env bash
# Run a command (the test suite) with the real outside parts the tests drive: headless Chromium
# and its driver, Prometheus, tmux, and a Docker engine with compose and swarm, plus the locally
# made base image the stack's image is built FROM. `make test` runs pytest through this script.
#
# As root on Debian, whatever is missing is installed from Debian's packages, a Docker engine is
# started if none answers (and stopped again when the command ends), and the base image is made
# once (docker/make-base-image.sh; Docker keeps it, and the stack image's layers, between runs).
# Anywhere else nothing is installed: the tests that need a missing part skip, naming it, and
# this script prints the one command that would install them.
#   scripts/with_system.sh <command> [args...]
# BLITZMESH_SYSTEM_PARTS=0 skips all of this (the tests then skip what is missing).
set -uo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(chromium chromium-driver prometheus tmux docker.io docker-compose debootstrap iproute2)
BASE_IMAGE=blitzmesh-base:bookworm
started_dockerd=""

note() { echo "with_system: $*" >&2; }

missing_packages() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  echo "${missing[@]:-}"
}

install_parts() {
  if [ ! -f /etc/debian_version ] || ! command -v dpkg-query >/dev/null; then
    note "not Debian: the browser, Prometheus and Docker tests skip unless those parts are installed"
    return
  fi
  local missing
  missing=$(missing_packages)
  [ -z "$missing" ] && return
  if [ "$(id -u)" != 0 ]; then
    note "missing: $missing; their tests skip. To run them: sudo apt-get install -y --no-install-recommends $missing"
    return
  fi
  note "installing $missing (Debian packages)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null || note "apt-get update failed; trying the install anyway"
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $missing >/dev/null || note "apt-get install failed: their tests skip"
}

start_docker() {
  command -v dockerd >/dev/null || return
  if docker info >/dev/null 2>&1; then return; fi
  [ "$(id -u)" = 0 ] || { note "no Docker engine runs; the Docker tests skip (start one: sudo dockerd)"; return; }
  mkdir -p run
  dockerd >run/dockerd.log 2>&1 &
  started_dockerd=$!
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && break
    sleep 0.5
  done
  if docker info >/dev/null 2>&1; then
    note "started a Docker engine for this run (pid $started_dockerd)"
  else
    note "dockerd did not answer within 30 s (see run/dockerd.log); the Docker tests skip"
  fi
}

make_base_image() {
  docker info >/dev/null 2>&1 || return
  docker image inspect python:3.11-slim >/dev/null 2>&1 && return
  docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && return
  [ "$(id -u)" = 0 ] && command -v debootstrap >/dev/null || return
  note "making $BASE_IMAGE (debootstrap, once per machine)"
  docker/make-base-image.sh "$BASE_IMAGE" >run/base-image.log 2>&1 || note "base image failed (run/base-image.log)"
}

stop_docker() {
  [ -n "$started_dockerd" ] || return 0
  kill "$started_dockerd" 2>/dev/null
  for _ in $(seq 40); do
    kill -0 "$started_dockerd" 2>/dev/null || break
    sleep 0.5
  done
  kill -9 "$started_dockerd" 2>/dev/null
  rm -f run/dockerd.log
  rmdir run 2>/dev/null
  return 0
}

if [ "${BLITZMESH_SYSTEM_PARTS:-1}" != 0 ]; then
  install_parts
  start_docker
  make_base_image
fi
trap stop_docker EXIT
"$@"
