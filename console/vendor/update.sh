#!/bin/sh
# The console's third-party files (uPlot), fetched from the npm registry and committed under
# console/static/vendor/, so a clean clone serves them with no network at all.
#
#   console/vendor/update.sh          fetch the version pinned in package-lock.json and copy it in
#   console/vendor/update.sh --check  fetch it again and fail if the committed files differ
#
# `npm ci` installs exactly what package-lock.json names and refuses a tarball whose sha512
# differs from the lockfile's "integrity"; no install scripts run. To move to another version:
# change package.json, run `npm install --package-lock-only --ignore-scripts` here, then this.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
dest="$here/../static/vendor/uplot"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$here/package.json" "$here/package-lock.json" "$work/"
(cd "$work" && npm ci --ignore-scripts --no-audit --no-fund --silent)
src="$work/node_modules/uplot"
# source file in the package → name under console/static/vendor/uplot/
files="dist/uPlot.esm.js:uPlot.esm.js dist/uPlot.min.css:uPlot.min.css LICENSE:LICENSE.txt"
status=0
for pair in $files; do
  from="$src/${pair%%:*}"
  to="$dest/${pair##*:}"
  if [ "${1:-}" = "--check" ]; then
    if ! cmp -s "$from" "$to"; then
      echo "console/static/vendor/uplot/${pair##*:} differs from uplot $(node -p "require('$src/package.json').version") on the registry" >&2
      status=1
    fi
  else
    mkdir -p "$dest"
    cp "$from" "$to"
  fi
done
if [ "${1:-}" != "--check" ]; then
  (cd "$dest" && sha256sum uPlot.esm.js uPlot.min.css LICENSE.txt > SHA256SUMS)
  echo "console/static/vendor/uplot/: uplot $(node -p "require('$src/package.json').version")"
fi
exit $status
