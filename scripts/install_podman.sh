#!/usr/bin/env bash
# podman, and a base image built here from Debian packages (no image registry needed): the container
# runtime of harness runs (env.sandbox.runtime: podman), for tests/test_container.py. The image,
# localhost/turnrl-debian:bookworm, is Debian bookworm's minbase with python3, made by mmdebstrap
# from the Debian mirror and imported with `podman import`; a task's Dockerfile may name it in FROM.
# Idempotent and quiet: prints one line for what it installs or builds.
set -euo pipefail
IMAGE=localhost/turnrl-debian:bookworm
here=$(dirname "$0")
missing=()
command -v podman >/dev/null || missing+=(podman)
command -v runc >/dev/null || missing+=(runc)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
if [ ${#missing[@]} -gt 0 ]; then
  bash "$here/apt_install.sh" install_podman.sh "${missing[@]}"
  echo "installed ${missing[*]} ($(podman --version))"
fi
podman image exists "$IMAGE" && exit 0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log=$work/log
if ! mmdebstrap --variant=minbase --include=python3 --quiet bookworm "$work/rootfs.tar" \
  http://deb.debian.org/debian >"$log" 2>&1 || ! podman import --quiet "$work/rootfs.tar" "$IMAGE" >>"$log" 2>&1; then
  cat "$log" >&2
  echo "install_podman.sh: could not build $IMAGE" >&2
  exit 1
fi
echo "built $IMAGE from Debian packages ($(podman image inspect --format '{{.Size}}' "$IMAGE") bytes)"
