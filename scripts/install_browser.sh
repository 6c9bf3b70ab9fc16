#!/usr/bin/env bash
# Headless Chromium and its WebDriver from Debian, for the viewer's browser tests.
# Idempotent and quiet; needs root (or sudo) only when something is missing.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
[ -x /usr/bin/chromedriver ] || missing+=(chromium-driver)
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
$SUDO apt-get update -qq </dev/null >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null >/dev/null
echo "installed: ${missing[*]}"
