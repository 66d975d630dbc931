#!/usr/bin/env bash
# Installs what the fuzz targets need: the nightly toolchain (cargo-fuzz
# builds with -Zsanitizer) and cargo-fuzz from crates.io, each only if missing.
# Idempotent; used by scripts/fuzz-smoke.sh and scripts/fuzz-run.sh.
set -euo pipefail

if ! rustup toolchain list | grep -q '^nightly'; then
    echo "fuzz-setup: installing the nightly toolchain" >&2
    rustup toolchain install nightly --profile minimal
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz-setup: installing cargo-fuzz from crates.io" >&2
    cargo install cargo-fuzz --locked
fi

cargo fuzz --version >&2
