#!/usr/bin/env bash
# Several hosts on one machine: N network namespaces on one bridge, each an addressable host with
# its own link (optionally shaped to a rate with the kernel's tbf qdisc), and an `mpirun` launch
# across them that enters a host's namespace instead of ssh-ing to it. Ranks on different hosts
# then talk over TCP through the bridge, never over shared memory. Needs root (or CAP_NET_ADMIN
# and CAP_SYS_ADMIN), iproute2, and the kernel's netns, veth, bridge and tbf support.
#
#   scripts/hosts.sh up N [--rate R]     make hosts fph-h0..fph-h<N-1> (R: unshaped, 10gbit, 1gbit,
#                                        100mbit or any tc rate; default unshaped)
#   scripts/hosts.sh rate R              reshape every host's link
#   scripts/hosts.sh link HOST up|down   take one host's link up or down (a network fault)
#   scripts/hosts.sh mpirun ARGS...      mpirun with one rank slot per host, TCP only, the
#                                        namespace launch agent (ARGS as for mpirun: -np N ...)
#   scripts/hosts.sh exec HOST CMD...    run a command on a host (in its namespace)
#   scripts/hosts.sh with N [--rate R] -- CMD...   up, run CMD, down (also on Ctrl-C or kill)
#   scripts/hosts.sh status | down | check
#   scripts/hosts.sh agent HOST CMD...   the launch agent mpirun calls (as it would call ssh)
#
# Addresses: host i is 10.77.0.(i+1); mpirun runs on a head node at 10.77.0.253; this
# machine's side of the bridge is 10.77.0.254, so a `serve` on host 0 is reached from here at
# http://10.77.0.1:PORT. The state (hostfile, rate) lives in $FLOWPREFILL_HOSTS_DIR (default
# /run/flowprefill-hosts-PREFIX).
set -uo pipefail

# Names and addresses; a second set of hosts (the test suite's) can live beside the first with
# another prefix (at most 5 characters: interface names are short) and network.
PREFIX=${FLOWPREFILL_HOSTS_PREFIX:-fph}
NET=${FLOWPREFILL_HOSTS_NET:-10.77.0}
BRIDGE=$PREFIX-br
# The head node: where mpirun runs (NET.253), a namespace of its own so that its TCP gives up on
# an unreachable host within seconds (tcp_retries2 is per namespace) without touching this
# machine's own settings.
HEAD=$PREFIX-head
STATE=${FLOWPREFILL_HOSTS_DIR:-/run/flowprefill-hosts-$PREFIX}
# How long the launch agent lets a host's link stay down before it drops the host, as ssh does
# with ServerAliveInterval=1 ServerAliveCountMax=N (seconds).
KEEPALIVE=${FLOWPREFILL_HOSTS_KEEPALIVE:-10}
[[ "$PREFIX" =~ ^[a-z][a-z0-9]{0,4}$ ]] || { echo "hosts.sh: FLOWPREFILL_HOSTS_PREFIX must be 1-5 lowercase letters or digits, got '$PREFIX'" >&2; exit 1; }
[[ "$NET" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "hosts.sh: FLOWPREFILL_HOSTS_NET must be the first three numbers of an address (10.77.0), got '$NET'" >&2; exit 1; }
SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")

die() {
  echo "hosts.sh: $*" >&2
  exit 1
}

host_name() { echo "$PREFIX-h$1"; }

# Every host namespace this script made (also ones left behind by an interrupted run).
hosts() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$PREFIX-h[0-9]+$" | sort -V; }

# What `up` needs, each missing piece named with what to do about it. Probes with a throwaway
# namespace, so that "cannot" is found before anything is half made.
check() {
  local problems=()
  command -v ip >/dev/null || problems+=("the ip command (Debian iproute2)")
  command -v tc >/dev/null || problems+=("the tc command (Debian iproute2)")
  command -v unshare >/dev/null || problems+=("the unshare command (Debian util-linux)")
  if [ ${#problems[@]} -eq 0 ]; then
    local probe=${PREFIX}p$(($$ % 100000))
    if ! ip netns add "$probe" 2>/dev/null; then
      problems+=("network namespaces: 'ip netns add' failed (needs root or CAP_SYS_ADMIN+CAP_NET_ADMIN, and a kernel with CONFIG_NET_NS)")
    else
      if ! ip link add "$probe-a" type veth peer name "$probe-b" 2>/dev/null; then
        problems+=("veth pairs: 'ip link add type veth' failed (kernel module veth)")
      else
        ip link add "$probe-c" type bridge 2>/dev/null || problems+=("bridges: 'ip link add type bridge' failed (kernel module bridge)")
        ip link del "$probe-c" 2>/dev/null
        tc qdisc add dev "$probe-a" root tbf rate 100mbit burst 32kb latency 50ms 2>/dev/null ||
          problems+=("link shaping: 'tc qdisc add ... tbf' failed (kernel module sch_tbf); unshaped hosts still work")
        ip netns exec "$probe" unshare --uts true 2>/dev/null || problems+=("UTS namespaces: 'unshare --uts' failed (each host needs its own host name)")
        ip link del "$probe-a" 2>/dev/null
      fi
      ip netns del "$probe" 2>/dev/null
    fi
  fi
  if [ ${#problems[@]} -gt 0 ]; then
    echo "hosts.sh cannot make hosts on this machine; missing:" >&2
    printf '  - %s\n' "${problems[@]}" >&2
    return 1
  fi
}

# tc's rate for a name, or "" for unshaped.
rate_of() {
  case "$1" in
    unshaped | none | "") echo "" ;;
    *[0-9]*bit | *[0-9]*bps) echo "$1" ;;
    *) die "unknown rate '$1': give unshaped, 10gbit, 1gbit, 100mbit or a tc rate such as 250mbit" ;;
  esac
}

# Bytes per second of a tc rate (for the bucket size).
rate_bytes() {
  local r=$1 n unit
  n=${r%%[a-zA-Z]*}
  unit=${r#"$n"}
  case "$unit" in
    gbit) echo $((n * 1000000000 / 8)) ;;
    mbit) echo $((n * 1000000 / 8)) ;;
    kbit) echo $((n * 1000 / 8)) ;;
    bit) echo $((n / 8)) ;;
    gbps) echo $((n * 1000000000)) ;;
    mbps) echo $((n * 1000000)) ;;
    kbps) echo $((n * 1000)) ;;
    bps) echo "$n" ;;
    *) die "cannot read the rate '$r'" ;;
  esac
}

# Shape both directions of host i's link: its namespace side (what it sends) and the bridge side
# (what it receives). The bucket holds 1 ms of traffic (at least 32 KiB, so that a full-size
# segment always fits); the queue holds 50 ms before tbf drops and TCP backs off.
shape() {
  local i=$1 rate=$2 host dev burst
  host=$(host_name "$i")
  dev=$PREFIX-v$i
  tc qdisc del dev "$dev" root 2>/dev/null
  ip netns exec "$host" tc qdisc del dev eth0 root 2>/dev/null
  [ -n "$rate" ] || return 0
  burst=$(($(rate_bytes "$rate") / 1000))
  [ "$burst" -ge 32768 ] || burst=32768
  tc qdisc add dev "$dev" root tbf rate "$rate" burst "$burst" latency 50ms ||
    die "tc could not shape $dev to $rate"
  ip netns exec "$host" tc qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms ||
    die "tc could not shape $host's eth0 to $rate"
}

# A namespace NS on the bridge: a veth pair, DEV on the bridge, eth0 at ADDR in NS.
attach() {
  local ns=$1 dev=$2 addr=$3
  ip netns add "$ns" &&
    ip link add "$dev" type veth peer name "$dev-p" &&
    ip link set "$dev-p" netns "$ns" &&
    ip netns exec "$ns" ip link set "$dev-p" name eth0 &&
    ip netns exec "$ns" ip addr add "$addr/24" dev eth0 &&
    ip netns exec "$ns" ip link set eth0 up &&
    ip netns exec "$ns" ip link set lo up &&
    ip link set "$dev" master "$BRIDGE" &&
    ip link set "$dev" up
}

down() {
  local h
  for h in $(hosts); do
    ip netns pids "$h" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ip netns del "$h" 2>/dev/null
  done
  # A host's veth goes with its namespace; a root-side end left by a half-made host goes here.
  for h in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E "^$PREFIX-v[0-9]+$"); do
    ip link del "$h" 2>/dev/null
  done
  ip netns pids "$HEAD" 2>/dev/null | xargs -r kill -9 2>/dev/null
  ip netns del "$HEAD" 2>/dev/null
  ip link del "$PREFIX-vh" 2>/dev/null
  ip link del "$BRIDGE" 2>/dev/null
  rm -rf "$STATE"
  return 0
}

up() {
  local n=${1:-} rate_name=unshaped
  shift || true
  while [ $# -gt 0 ]; do
    case "$1" in
      --rate) rate_name=${2:-}; shift 2 || die "--rate needs a value" ;;
      *) die "unknown option '$1' for up (usage: up N [--rate R])" ;;
    esac
  done
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 64 ] || die "up needs a host count from 1 to 64, got '$n'"
  local rate
  rate=$(rate_of "$rate_name") || exit 1
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces and links): run it as root or with sudo"
  check || exit 1
  [ -z "$(hosts)" ] || die "hosts are already up ($(hosts | tr '\n' ' ')); run 'scripts/hosts.sh down' first"
  # A failure half way leaves nothing behind.
  trap 'down; exit 1' INT TERM
  ip link add "$BRIDGE" type bridge || { down; die "could not make the bridge $BRIDGE"; }
  ip addr add "$NET.254/24" dev "$BRIDGE" && ip link set "$BRIDGE" up || { down; die "could not address the bridge"; }
  # The head node: about 3 s of retransmissions before a connection to a silent host fails
  # (the default, 15, is about 15 minutes).
  if ! { attach "$HEAD" "$PREFIX-vh" "$NET.253" && ip netns exec "$HEAD" sysctl -q -w net.ipv4.tcp_retries2=4; }; then
    down
    die "could not make the head node $HEAD"
  fi
  local i host
  for ((i = 0; i < n; i++)); do
    host=$(host_name "$i")
    attach "$host" "$PREFIX-v$i" "$NET.$((i + 1))" || { down; die "could not make host $host"; }
    shape "$i" "$rate" || { down; exit 1; }
  done
  mkdir -p "$STATE"
  : >"$STATE/hostfile"
  for ((i = 0; i < n; i++)); do echo "$(host_name "$i") slots=1" >>"$STATE/hostfile"; done
  echo "${rate:-unshaped}" >"$STATE/rate"
  trap - INT TERM
  # Every host reaches every other before anyone relies on it.
  for ((i = 0; i < n; i++)); do
    ip netns exec "$(host_name "$i")" ping -c 1 -W 2 "$NET.254" >/dev/null 2>&1 ||
      { [ -x "$(command -v ping)" ] && { down; die "host $(host_name "$i") cannot reach the bridge"; }; }
  done
  echo "hosts up: $n ($(hosts | tr '\n' ' ')), link ${rate:-unshaped}; hostfile $STATE/hostfile"
}

status() {
  local hs
  hs=$(hosts)
  if [ -z "$hs" ]; then
    echo "no hosts up"
    return 0
  fi
  echo "hosts: $(echo "$hs" | tr '\n' ' ')"
  echo "link: $(cat "$STATE/rate" 2>/dev/null || echo unknown)"
  echo "hostfile: $STATE/hostfile"
  local h
  for h in $hs; do
    printf '  %s %s\n' "$h" "$(ip netns exec "$h" ip -o -4 addr show dev eth0 2>/dev/null | awk '{print $4, $9}')"
  done
}

# The launch agent: mpirun calls it as it would call ssh (`agent HOST COMMAND...`, the command a
# string for a shell). It runs the command in the host's network namespace and a UTS namespace
# named after the host, so that OpenMPI sees distinct nodes (no shared-memory transport). Like
# ssh with keepalives it watches the connection: a host whose link stays down KEEPALIVE seconds
# is unreachable, so its processes go (as a remote orted goes when its ssh session dies) and the
# agent exits 255, which is how mpirun learns that a host is lost instead of waiting forever.
agent() {
  local host=${1:-}
  shift || true
  # ssh's options (mpirun may pass -x or similar) are skipped.
  while [ "${host#-}" != "$host" ]; do
    host=${1:-}
    shift || true
  done
  [ -n "$host" ] || die "agent needs a host"
  ip netns list | awk '{print $1}' | grep -qx "$host" || die "no host '$host' (is it up? scripts/hosts.sh status)"
  ip netns exec "$host" unshare --uts sh -c 'hostname "$1"; shift; exec sh -c "$*"' agent "$host" "$@" &
  local child=$! ticks=0
  trap 'kill -TERM $child 2>/dev/null' TERM INT HUP
  while kill -0 "$child" 2>/dev/null; do
    sleep 0.25
    if ip -n "$host" -o link show eth0 2>/dev/null | grep -q "state UP"; then
      ticks=0
    else
      ticks=$((ticks + 1))
    fi
    if [ "$ticks" -ge $((KEEPALIVE * 4)) ]; then
      echo "hosts.sh agent: host $host unreachable for ${KEEPALIVE} s (its link is down): dropping it, as ssh would" >&2
      # (bash's own "Killed" notice for the child is not news: quiet from here.)
      exec 2>/dev/null
      ip netns pids "$host" 2>/dev/null | xargs -r kill -9
      exit 255
    fi
  done
  local rc=0
  { wait "$child"; } 2>/dev/null || rc=$?
  # What ssh says when the far side goes away: the daemon did not exit, it was killed.
  [ "$rc" -le 128 ] || echo "hosts.sh agent: host $host lost: its processes were killed (signal $((rc - 128)))" >&2
  return "$rc"
}

mpirun_across() {
  [ -f "$STATE/hostfile" ] || die "no hosts are up: run 'scripts/hosts.sh up N' first"
  # TCP only (no shared memory, no other fabric), between the hosts' addresses; daemons started
  # by the agent from here (no tree spawn, so no agent runs inside a host); no binding, because
  # every host's daemon would bind its one rank to the first core (the hosts share this
  # machine's cores, each believing it has them all). The session stays attached, so that the
  # agent's end means a lost host to mpirun. mpirun runs on the head node, whose TCP gives up
  # on a silent host after a few seconds, so that a job aborted while a host is unreachable
  # ends instead of waiting for that host's daemon (OpenMPI has no timeout of its own there);
  # OOB keepalives find a silent host on an idle connection.
  local root=()
  [ "$(id -u)" != 0 ] || root=(--allow-run-as-root)
  exec ip netns exec "$HEAD" mpirun "${root[@]}" --hostfile "$STATE/hostfile" --leave-session-attached \
    --mca oob_tcp_keepalive_time "$KEEPALIVE" --mca oob_tcp_keepalive_intvl 1 --mca oob_tcp_keepalive_probes 3 \
    --mca plm_rsh_agent "$SELF agent" \
    --mca plm_rsh_no_tree_spawn 1 \
    --bind-to none \
    --mca btl tcp,self \
    --mca btl_tcp_if_include "$NET.0/24" \
    --mca oob_tcp_if_include "$NET.0/24" \
    --mca pml ob1 \
    --mca osc '^ucx' \
    "$@"
}

with() {
  local args=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    args+=("$1")
    shift
  done
  [ "${1:-}" = "--" ] || die "with needs '--' before the command (with N [--rate R] -- CMD...)"
  shift
  [ $# -gt 0 ] || die "with needs a command after '--'"
  up "${args[@]}" || exit 1
  trap 'down' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  "$@"
}

cmd=${1:-}
shift || true
case "$cmd" in
  up) up "$@" ;;
  down) down ;;
  status) status ;;
  check) check && echo "hosts.sh can make hosts here" ;;
  rate)
    [ -n "$(hosts)" ] || die "no hosts are up"
    r=$(rate_of "${1:-}") || exit 1
    for h in $(hosts); do shape "${h#"$PREFIX"-h}" "$r"; done
    echo "${r:-unshaped}" >"$STATE/rate"
    ;;
  link)
    h=${1:-}
    [ -n "$h" ] && ip netns list | awk '{print $1}' | grep -qx "$h" || die "no host '$h'"
    case "${2:-}" in
      up | down) ip link set "$PREFIX-v${h#"$PREFIX"-h}" "$2" ;;
      *) die "link needs up or down" ;;
    esac
    ;;
  exec)
    h=${1:-}
    shift || true
    [ -n "$h" ] && ip netns list | awk '{print $1}' | grep -qx "$h" || die "no host '$h'"
    exec ip netns exec "$h" "$@"
    ;;
  agent) agent "$@" ;;
  mpirun) mpirun_across "$@" ;;
  with) with "$@" ;;
  *)
    sed -n '2,/^set -uo/p' "$SELF" | grep '^#' | sed 's/^# \{0,1\}//'
    [ -z "$cmd" ] || [ "$cmd" = help ] || [ "$cmd" = -h ] || exit 2
    ;;
esac
