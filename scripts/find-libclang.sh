#!/usr/bin/env bash
# Prints the libclang shared library that bindgen (the `mpi` crate's build script) will load, and
# exits 1 with nothing on stdout when there is none. It searches as clang-sys 1.9 does at build
# time (runtime loading):
#   - LIBCLANG_PATH, when set, and nothing else (a file, or a folder);
#   - otherwise `llvm-config --prefix`/{bin,lib,lib64}, LD_LIBRARY_PATH, LIBRARY_PATH, then
#     /usr/local/llvm*/lib*, /usr/local/lib*/*/*, /usr/local/lib*/*, /usr/local/lib*,
#     /usr/lib*/*/*, /usr/lib*/*, /usr/lib*;
#   - names libclang.so, libclang-*.so, libclang.so.*, libclang-*.so.*, never libclang-cpp*
#     (Clang's C++ library, which bindgen cannot use: matching it is how issue 28 happened).
# FLOWPREFILL_SYSROOT prefixes the fixed folders (the tests point it at a fake tree).
#
#   bash scripts/find-libclang.sh            # the path, or exit 1
#   bash scripts/find-libclang.sh --all      # every candidate, in search order
set -uo pipefail
all=0
[ "${1:-}" = "--all" ] && all=1
root="${FLOWPREFILL_SYSROOT:-}"
found=()

# The files of folder $1 whose names bindgen would load.
scan() {
  local dir="$1" f name
  [ -d "$dir" ] || return 0
  for f in "$dir"/libclang.so "$dir"/libclang-*.so "$dir"/libclang.so.* "$dir"/libclang-*.so.*; do
    [ -e "$f" ] || continue
    name="${f##*/}"
    case "$name" in *-cpp.* | libclang-cpp*) continue ;; esac
    found+=("$f")
  done
}

if [ -n "${LIBCLANG_PATH:-}" ]; then
  if [ -f "$LIBCLANG_PATH" ]; then
    scan "$(dirname "$LIBCLANG_PATH")"
    match=()
    for f in "${found[@]}"; do [ "${f##*/}" = "${LIBCLANG_PATH##*/}" ] && match+=("$f"); done
    found=("${match[@]}")
  else
    scan "$LIBCLANG_PATH"
  fi
else
  llvm_config="${LLVM_CONFIG_PATH:-llvm-config}"
  if prefix=$("$llvm_config" --prefix 2>/dev/null) && [ -n "$prefix" ]; then
    for sub in bin lib lib64; do scan "$prefix/$sub"; done
  fi
  for var in LD_LIBRARY_PATH LIBRARY_PATH; do
    IFS=: read -r -a dirs <<<"${!var:-}"
    for d in "${dirs[@]}"; do [ -n "$d" ] && scan "$d"; done
  done
  shopt -s nullglob
  for pattern in "/usr/local/llvm*/lib*" "/usr/local/lib*/*/*" "/usr/local/lib*/*" "/usr/local/lib*" \
    "/usr/lib*/*/*" "/usr/lib*/*" "/usr/lib*"; do
    for d in $root$pattern; do scan "$d"; done
  done
fi

[ ${#found[@]} -gt 0 ] || exit 1
if [ $all = 1 ]; then
  printf '%s\n' "${found[@]}"
else
  printf '%s\n' "${found[0]}"
fi
