#!/usr/bin/env bash
# The network study of docs/network.md: `bench ttft` across hosts made by scripts/hosts.sh (one
# rank per host, TCP between them) at each link rate, with the projection's prediction for the
# same link beside every cell (a link profile measured by `bench calibrate --link-name` across
# the hosts, both ways at once and one way; the device by `bench calibrate`, alone for the one-host
# row and `--concurrent` on every host at once for the others), then `bench network` for the
# table, CSV and plot. Needs root (network namespaces), OpenMPI and a build with `--features mpi`.
#
#   scripts/network-study.sh OUT [--hosts 2,4] [--rates unshaped,1gbit,100mbit] [--lengths 4096]
#                               [--runs 3] [--threads 1] [--bin target/release/flowprefill]
#                               [--model NAME]   (the model of every run; default SmolLM2-135M. Use
#                                                  one OUT per model: `bench network` reads it as one study)
#
# Every point is resumable: a folder that already has its ttft.csv is skipped, so a study can be
# run in parts (say `--hosts 2` first, `--hosts 4` later) into one OUT.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:?usage: network-study.sh OUT [--hosts 2,4] [--rates ...] [--lengths ...] [--runs N]}
shift
hosts_list=2,4 rates=unshaped,1gbit,100mbit lengths=4096 runs=3 threads=1 bin=target/release/flowprefill
model=()
while [ $# -gt 0 ]; do
  case "$1" in
    --hosts) hosts_list=$2 ;;
    --rates) rates=$2 ;;
    --lengths) lengths=$2 ;;
    --runs) runs=$2 ;;
    --threads) threads=$2 ;;
    --bin) bin=$2 ;;
    --model) model=(--model "$2") ;;
    *) echo "network-study.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift 2
done
[ -x "$bin" ] || { echo "network-study.sh: no $bin (cargo build --release -p flowprefill --features mpi)" >&2; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# Every run starts cold and nothing is learnt between them.
export FLOWPREFILL_STORE=off FLOWPREFILL_HISTORY=off
mkdir -p "$out/links"
hosts=("$here/hosts.sh")
"${hosts[@]}" check
trap '"${hosts[@]}" down' EXIT

# The device (one rank, this many threads) once; single-host full prefill once per length.
[ -f "$out/cpu-local.json" ] || "$bin" --threads "$threads" bench calibrate "${model[@]}" --out "$out/cpu-local.json"
for len in ${lengths//,/ }; do
  [ -f "$out/full/$len/ttft.csv" ] && continue
  "$bin" --threads "$threads" bench ttft "${model[@]}" --lengths "$len" --ranks 1 --methods full --runs "$runs" \
    --project cpu-local --profiles "$out/cpu-local.json" --out "$out/full/$len"
done

for n in ${hosts_list//,/ }; do
  # The device as a rank gets it while every host computes (memory bandwidth, and cores shared
  # when there are more hosts than cores): measured by all n ranks at once, once per n.
  device=cpu-busy-$n device_file=$out/cpu-busy-$n.json
  if [ ! -f "$device_file" ]; then
    "${hosts[@]}" down
    "${hosts[@]}" up "$n"
    "${hosts[@]}" mpirun -np "$n" "$bin" --threads "$threads" bench calibrate "${model[@]}" --concurrent \
      --device-name "$device" --out "$device_file"
  fi
  for rate in ${rates//,/ }; do
    "${hosts[@]}" down
    "${hosts[@]}" up "$n" --rate "$rate"
    link=hosts-$rate
    [ -f "$out/links/$link.json" ] ||
      "${hosts[@]}" mpirun -np 2 "$bin" --threads "$threads" bench calibrate --link-name "$link" --out "$out/links/$link.json"
    for len in ${lengths//,/ }; do
      for scope in exact sparse; do
        dir=$out/$n-hosts/$rate/$len/$scope
        [ -f "$dir/ttft.csv" ] && continue
        methods=infoflow
        [ "$scope" = exact ] && methods=ring,infoflow
        echo "== $n hosts, link $rate, $len tokens, $methods (scope $scope)"
        "${hosts[@]}" mpirun -np "$n" "$bin" --threads "$threads" bench ttft "${model[@]}" --lengths "$len" --ranks "$n" \
          --methods "$methods" --scope "$scope" --runs "$runs" --project "$device" \
          --profiles "$device_file" --profiles "$out/links/$link.json" --link "$link" --out "$dir"
      done
    done
  done
done
"$bin" bench network "$out"
