#!/usr/bin/env bash
# Installs everything pgoutbox needs on a fresh Debian 12 machine, idempotently:
# Debian packages only when missing (apt-get once), then a venv in .venv that is
# rebuilt only when pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_PACKAGES=(postgresql-15 postgresql-15-pgtap libtap-parser-sourcehandler-pgtap-perl
              libpostgresql-jdbc-java openjdk-17-jre-headless
              chromium)  # chromium: the console's browser tests (Playwright launches Debian's)
missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "bootstrap: missing Debian packages (${missing[*]}); run as root or install them" >&2
    exit 1
  fi
  echo "bootstrap: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # The cluster Debian creates by default is not used: pgoutbox starts its own.
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
stamp=.venv/.pgoutbox-stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: building .venv"
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[dev,spark]'
  echo "$want" > "$stamp"
fi

# promtool (tests/cli/test_metrics.py runs `promtool check metrics` on the workers'
# /metrics), taken out of Debian's prometheus package rather than installed:
# installing the package would also start a Prometheus server. Without it the rest
# of the suite still runs; those tests fail and say so.
if [ ! -x .venv/bin/promtool ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  download() { (cd "$tmp" && apt-get download -q prometheus >/dev/null 2>&1); }
  if download || { [ "$(id -u)" -eq 0 ] && apt-get update -qq && download; }; then
    dpkg-deb --fsys-tarfile "$tmp"/prometheus_*.deb | tar -x -C "$tmp" ./usr/bin/promtool
    install -m 0755 "$tmp/usr/bin/promtool" .venv/bin/promtool
    echo "bootstrap: $(.venv/bin/promtool --version 2>&1 | head -1) in .venv/bin"
  else
    echo "bootstrap: cannot download Debian's prometheus package for promtool (run as root once," \
         "or put promtool in .venv/bin); the metrics tests will fail until then" >&2
  fi
fi
