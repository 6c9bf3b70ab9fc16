#!/usr/bin/env bash
# apt_install.sh WHO PACKAGE...: apt-get install the packages (as root, or with sudo -n), quietly:
# one line when it installs them, apt's log only when apt fails. Used by the install_*.sh scripts.
# Several may run at once (scripts/test.sh runs the installs side by side): one at a time holds
# apt, the others wait for its lock (flock) instead of failing on dpkg's.
set -euo pipefail
who=$1
shift
if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null; then
  as_root=(sudo -n)
else
  echo "$who: need root (or sudo) to apt-get install $*" >&2
  exit 1
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
export DEBIAN_FRONTEND=noninteractive
exec 9>"${TMPDIR:-/tmp}/turnrl-apt.lock"
flock 9
if ! { "${as_root[@]}" apt-get update -qq && "${as_root[@]}" apt-get install -y -qq --no-install-recommends \
  "$@"; } </dev/null >"$log" 2>&1; then
  cat "$log" >&2
  echo "$who: apt-get install $* failed" >&2
  exit 1
fi
