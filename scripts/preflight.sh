#!/usr/bin/env bash
# What the test command needs besides the Rust toolchain, each checked with what to install
# (`.ci/run` installs the Debian packages as root; elsewhere this says which). Exit 1 naming
# every missing piece, else 0 and nothing printed. `scripts/test.sh` runs it first.
set -uo pipefail
missing=()
cargo fmt --version >/dev/null 2>&1 || missing+=("rustfmt: rustup component add rustfmt")
cargo clippy --version >/dev/null 2>&1 || missing+=("clippy: rustup component add clippy")
# The CPU launch shim (kernels-emu) compiles the CUDA kernels as C++20.
if ! echo 'int main() { return 0; }' | "${CXX:-c++}" -std=c++20 -x c++ - -o /dev/null >/dev/null 2>&1; then
  missing+=("a C++20 compiler (${CXX:-c++} failed on -std=c++20): Debian g++ (10 or later) or clang, or set CXX")
fi
py=${FLOWPREFILL_PYTHON:-python3}
pip_version=$("$py" -m pip --version 2>/dev/null | awk '{print $2}') || true
if [ -z "$pip_version" ]; then
  missing+=("pip ($py -m pip): Debian python3-pip, or set FLOWPREFILL_PYTHON to a Python with pip")
elif ! printf '22.1\n%s\n' "$pip_version" | sort -V -C; then
  missing+=("pip 22.1 or later (found $pip_version): $py -m pip install --upgrade pip")
fi
# The charts of eval/bench/train need a TrueType font (lab/src/plot.rs looks where Debian's
# fonts-dejavu-core puts it, among others; FLOWPREFILL_FONT names another).
if [ -n "${FLOWPREFILL_FONT:-}" ]; then
  [ -f "$FLOWPREFILL_FONT" ] || missing+=("the font FLOWPREFILL_FONT names ($FLOWPREFILL_FONT) does not exist")
else
  font=
  for f in /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf /usr/share/fonts/TTF/DejaVuSans.ttf \
    /usr/share/fonts/dejavu/DejaVuSans.ttf /usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf \
    /usr/share/fonts/liberation/LiberationSans-Regular.ttf; do
    [ -f "$f" ] && font=$f
  done
  [ -n "$font" ] || missing+=("a TrueType font: Debian fonts-dejavu-core, or set FLOWPREFILL_FONT to a .ttf file")
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "scripts/test.sh needs (bash .ci/run installs the Debian packages, as root):" >&2
  printf '  - %s\n' "${missing[@]}" >&2
  exit 1
fi
