#!/usr/bin/env bash
# Network faults across hosts (the rows of docs/faults.md "Across hosts"): two hosts made by
# scripts/hosts.sh, one `mpirun` across them, and during each phase of a job host 1's link is
# taken down (or host 1 lost: link down and its processes gone, as a machine that powers off).
# A `run` must end naming the lost rank and `serve` must answer 503 and stop; a link shaped to a
# crawl must end by the deadline. Nothing may hang: every wait here has a limit, and a row that
# reaches it says "hung". Needs root, OpenMPI and a build with `--features mpi`.
#
#   scripts/hosts-faults.sh [OUT.md]     (default bench-out/hosts-faults.md; BIN= the binary)
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:-bench-out/hosts-faults.md}
bin=${BIN:-target/release/flowprefill}
H=$here/hosts.sh
# Hosts of their own (prefix and network), so that a study's hosts can stay up beside them.
export FLOWPREFILL_HOSTS_PREFIX=${FLOWPREFILL_HOSTS_PREFIX:-fpf} FLOWPREFILL_HOSTS_NET=${FLOWPREFILL_HOSTS_NET:-10.79.0}
# The launch agent drops a host whose link stays down this long: well above --comm-timeout plus
# a phase's compute, so that flowprefill names the lost rank before mpirun drops its host.
export FLOWPREFILL_HOSTS_KEEPALIVE=${FLOWPREFILL_HOSTS_KEEPALIVE:-20}
h0=$FLOWPREFILL_HOSTS_PREFIX-h0 h1=$FLOWPREFILL_HOSTS_PREFIX-h1 addr0=$FLOWPREFILL_HOSTS_NET.1
TIMEOUT=5 # --comm-timeout of every row
TOKEN=hosts-faults # serve listens on a host's address, which needs a token
ROWS=${ROWS:-run host serve crawl} # which groups of rows to make
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 FLOWPREFILL_STORE=off FLOWPREFILL_HISTORY=off
[ -x "$bin" ] || { echo "hosts-faults.sh: no $bin (cargo build --release -p flowprefill --features mpi)" >&2; exit 1; }
"$H" check || exit 1
"$H" down
"$H" up 2 || exit 1
tmp=$(mktemp -d)
trap '"$H" down; kill $(jobs -p) 2>/dev/null; rm -rf "$tmp"' EXIT
mkdir -p "$(dirname "$out")"

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
# Waits until FILE contains PATTERN or PID ends or LIMIT seconds pass; true when found.
wait_for() {
  local file=$1 pattern=$2 pid=$3 limit=$4 t0
  t0=$(now)
  while ! grep -q -- "$pattern" "$file" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { grep -q -- "$pattern" "$file" 2>/dev/null; return; }
    [ "$(secs "$t0" "$(now)" | cut -d. -f1)" -lt "$limit" ] || return 1
    sleep 0.05
  done
}
# Waits for PID (a child of this shell) up to LIMIT seconds, then kills it; sets $status to its
# exit status or "hung" (not a command substitution: a subshell cannot wait for this shell's
# children).
wait_exit() {
  local pid=$1 limit=$2 t0
  t0=$(now)
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$(secs "$t0" "$(now)" | cut -d. -f1)" -ge "$limit" ]; then
      kill -9 "$pid" 2>/dev/null
      wait "$pid" 2>/dev/null
      status=hung
      return
    fi
    sleep 0.05
  done
  wait "$pid"
  status="exit $?"
}
# The first line of a log that names what went wrong (flowprefill's error, or mpirun's).
message() {
  grep -m1 -E "^(error|Error)|rank [0-9]+ (was lost|did not answer)|lost|unreachable|noticed that process rank" "$1" |
    cut -c1-150 | tr '|' '/'
}
# POSTs the job in file $1 to the server on host 0 (port $port): status code to $tmp/code,
# the body to $tmp/body.
post() {
  curl -s -m 120 -o "$tmp/body" -w '%{http_code}' -H 'Content-Type: application/json' \
    -H "Authorization: Bearer $TOKEN" --data-binary @"$1" "http://$addr0:$port/v1/jobs" >"$tmp/code" 2>/dev/null
}
# The last reply's error message, or its answer.
reply() {
  python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); print((v.get("error") or {}).get("message") or v.get("answer",""))' \
    "$tmp/body" 2>/dev/null | cut -c1-150 | tr '|' '/'
}
break_host() {
  case "$1" in
    link) "$H" link "$h1" down ;;
    host) "$H" link "$h1" down; ip netns pids "$h1" | xargs -r kill -9 ;;
  esac
}
mend() {
  "$H" link "$h1" up
  for h in "$h0" "$h1"; do ip netns pids "$h" 2>/dev/null | xargs -r kill -9 2>/dev/null; done
  sleep 1
}

docs=()
for i in 0 1 2 3 4 5; do
  f=$tmp/d$i.txt
  for s in $(seq 0 24); do
    printf 'The keeper of tower %d counted %d lanterns near the river in year %d. ' "$i" $((s * 7 + i)) $((1800 + s))
    [ "$i" = 3 ] && [ "$s" = 12 ] && printf 'The access code for the north gate is 4729. '
  done >"$f"
  docs+=(--doc "$f")
done
query="What is the access code for the north gate?"
python3 - "$tmp" >"$tmp/job.json" <<'EOF'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
docs = [(d / f"d{i}.txt").read_text() for i in range(6)]
print(json.dumps({"documents": docs, "query": "What is the access code for the north gate?", "max_tokens": 12, "deadline_s": 60}))
EOF

rows=()
row() { rows+=("| $*"); echo "| $*"; }

# `run` under mpirun: rank 1 stalls 1.5 s on reaching the phase, the link goes while it does.
for fault in link host; do
  group=run
  [ "$fault" = link ] || group=host
  [[ " $ROWS " == *" $group "* ]] || continue
  for phase in chunk_prefill probe recompute final_prompt decode; do
    [ "$fault" = host ] && [ "$phase" != recompute ] && continue
    log=$tmp/run-$fault-$phase.log
    FLOWPREFILL_FAULT="rank:1,phase:$phase,mode:stall:1500" "$H" mpirun -np 2 "$bin" --threads 1 run "${docs[@]}" \
      --query "$query" --method infoflow --max-tokens 24 --comm-timeout "$TIMEOUT" >"$log" 2>&1 &
    pid=$!
    if ! wait_for "$log" "injected fault" "$pid" 180; then
      wait_exit "$pid" 60
      row "run | $fault on host 1 during $phase | (the phase was not reached) | $(message "$log") | - | $status |"
      mend
      continue
    fi
    cut=$(now)
    break_host "$fault"
    named=-
    wait_for "$log" "rank 1" "$pid" 60 && named="$(secs "$cut" "$(now)") s"
    wait_exit "$pid" 90
    row "run | $( [ "$fault" = link ] && echo "link of host 1 down" || echo "host 1 lost (link down, processes gone)") during $phase | $status after $(secs "$cut" "$(now)") s | $(message "$log") | $named | - |"
    mend
  done
done

# `serve` under mpirun on host 0 (reached from here at $addr0): the job's status and
# message, then the server's own exit.
port=18090
[[ " $ROWS " == *" serve "* ]] && for phase in chunk_prefill probe recompute final_prompt decode; do
  log=$tmp/serve-$phase.log
  FLOWPREFILL_FAULT="rank:1,phase:$phase,mode:stall:1500" "$H" mpirun -np 2 "$bin" --threads 1 serve \
    --listen "$addr0:$port" --token "$TOKEN" --comm-timeout "$TIMEOUT" >"$log" 2>&1 &
  pid=$!
  if ! wait_for "$log" "http://" "$pid" 120; then
    wait_exit "$pid" 30
    row "serve | link of host 1 down during $phase | (did not start) | $(message "$log") | - | $status |"
    mend
    continue
  fi
  t0=$(now)
  post "$tmp/job.json" &
  cpid=$!
  if wait_for "$log" "injected fault" "$pid" 120; then
    cut=$(now)
    break_host link
  else
    cut=$(now)
  fi
  wait "$cpid"
  answered="$(secs "$cut" "$(now)") s"
  code=$(cat "$tmp/code")
  msg=$(reply)
  wait_exit "$pid" 90
  row "serve | link of host 1 down during $phase | ${code:-no answer} | $msg | $answered | server $status after $(secs "$cut" "$(now)") s |"
  mend
  port=$((port + 1))
done

# A link shaped to a crawl: 1 Mbit/s. `run` of ring attention (its K/V blocks are megabytes)
# ends by --comm-timeout; a served job with a 10 s deadline ends by its deadline.
if [[ " $ROWS " == *" crawl "* ]]; then
"$H" rate 1mbit
log=$tmp/crawl-run.log
t0=$(now)
"$H" mpirun -np 2 "$bin" --threads 1 run "${docs[@]}" --query "$query" --method ring --max-tokens 8 \
  --comm-timeout 10 >"$log" 2>&1 &
pid=$!
wait_exit "$pid" 180
row "run | link of 1 Mbit/s (ring, --comm-timeout 10) | $status after $(secs "$t0" "$(now)") s | $(message "$log") | - | - |"
mend
log=$tmp/crawl-serve.log
"$H" mpirun -np 2 "$bin" --threads 1 serve --listen "$addr0:$port" --token "$TOKEN" --comm-timeout 60 >"$log" 2>&1 &
pid=$!
if wait_for "$log" "http://" "$pid" 120; then
  sed 's/"deadline_s": 60/"deadline_s": 10/' "$tmp/job.json" >"$tmp/job10.json"
  python3 - "$tmp/job10.json" <<'EOF'
import json, sys
p = sys.argv[1]
v = json.load(open(p))
v["method"] = "ring"
json.dump(v, open(p, "w"))
EOF
  t0=$(now)
  post "$tmp/job10.json"
  code=$(cat "$tmp/code")
  answered="$(secs "$t0" "$(now)") s"
  msg=$(reply)
  ready=$(curl -s -m 10 -o /dev/null -w '%{http_code}' "http://$addr0:$port/readyz")
  kill -USR1 "$pid" 2>/dev/null
  wait_exit "$pid" 60
  row "serve | link of 1 Mbit/s (ring, deadline 10 s, --comm-timeout 60) | ${code:-no answer} | $msg | $answered | /readyz $ready; server $status on SIGUSR1 |"
else
  wait_exit "$pid" 30
  row "serve | link of 1 Mbit/s | (did not start) | $(message "$log") | - | $status |"
fi

fi

{
  echo "| command | fault | outcome | message | named / answered after the fault | after |"
  echo "| --- | --- | --- | --- | --- | --- |"
  printf '%s\n' "${rows[@]}"
} >"$out"
echo "wrote $out"
