#!/usr/bin/env bash
# Debian's headless-capable Chromium for the viewer's browser tests (tests/test_viewer.py drive it
# over the DevTools pipe: no WebDriver, no browser download). Idempotent and quiet: prints nothing
# when Chromium is already there, one line when it installs it, apt's log only when apt fails.
set -euo pipefail
packages=()
[ -x /usr/bin/chromium ] || packages+=(chromium)
[ -d /usr/share/fonts/truetype/dejavu ] || packages+=(fonts-dejavu-core)
[ ${#packages[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null; then
  as_root=(sudo -n)
else
  echo "install_browser.sh: need root (or sudo) to apt-get install ${packages[*]}" >&2
  exit 1
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
export DEBIAN_FRONTEND=noninteractive
if ! { "${as_root[@]}" apt-get update -qq && "${as_root[@]}" apt-get install -y -qq --no-install-recommends \
  "${packages[@]}"; } </dev/null >"$log" 2>&1; then
  cat "$log" >&2
  echo "install_browser.sh: apt-get install ${packages[*]} failed" >&2
  exit 1
fi
echo "installed ${packages[*]} ($(/usr/bin/chromium --version 2>/dev/null | head -n 1))"
