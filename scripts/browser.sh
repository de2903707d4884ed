#!/usr/bin/env bash
# Make sure Debian's chromium is installed for the dashboard's browser tests (Playwright drives
# it; no browser is ever downloaded by Playwright itself). Quick when it is already there.
set -euo pipefail
browser="${JOBPLANE_TEST_CHROMIUM:-/usr/bin/chromium}"
if [ -x "$browser" ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "browser: $browser is missing and apt-get is not available;" \
       "install chromium or set JOBPLANE_TEST_CHROMIUM to a chromium binary" >&2
  exit 1
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "browser: installing chromium" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium >/dev/null
[ -x "$browser" ] || { echo "browser: chromium did not install at $browser" >&2; exit 1; }
echo "browser: chromium installed" >&2
