#!/usr/bin/env bash
# Debian's headless-capable Chromium for the viewer's browser tests (tests/test_viewer.py drive it
# over the DevTools pipe: no WebDriver, no browser download). Idempotent and quiet: prints nothing
# when Chromium is already there, one line when it installs it, apt's log only when apt fails.
set -euo pipefail
packages=()
[ -x /usr/bin/chromium ] || packages+=(chromium)
[ -d /usr/share/fonts/truetype/dejavu ] || packages+=(fonts-dejavu-core)
[ ${#packages[@]} -eq 0 ] && exit 0
bash "$(dirname "$0")/apt_install.sh" install_browser.sh "${packages[@]}"
echo "installed ${packages[*]} ($(/usr/bin/chromium --version 2>/dev/null | head -n 1))"
