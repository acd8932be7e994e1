#!/usr/bin/env bash
# Several hosts on one machine, made of Linux network namespaces, for running fivefold across
# "machines" exactly as on a cluster: each host is a namespace with its own network stack, one
# interface (eth0) cabled to a switch, an address in a private subnet, and its own hostname; the
# switch is a bridge in a namespace of its own. Nothing is added to this machine's own network:
# the subnet exists only inside the namespaces, and no traffic leaves them. Needs root (or
# CAP_NET_ADMIN and CAP_SYS_ADMIN); `hosts.sh check` says whether this machine allows it.
#
#   hosts.sh check                    # exit 0 if namespaces can be made here, else say why
#   hosts.sh up N [NAME]              # hosts NAME-1 .. NAME-N (NAME: ff), addresses 10.231.0.1..N
#   hosts.sh hostfile [NAME] [SLOTS]  # an mpirun hostfile of those hosts, SLOTS each (1)
#   hosts.sh run HOST CMD...          # run CMD inside HOST: its network and its hostname
#   hosts.sh agent HOST CMD...        # the same, joined into one shell command, as ssh runs it:
#                                     #   mpirun --mca plm_rsh_agent "scripts/hosts.sh agent"
#   hosts.sh mpirun [NAME] [--per-host K] -- ARGS...
#                                     # mpirun from host NAME-1 over the hosts, K ranks a host (1),
#                                     # consecutive ranks on one host; MPI over TCP only
#   hosts.sh link HOST down|up        # unplug / plug the host's cable at the switch
#   hosts.sh kill HOST                # SIGKILL every process inside HOST
#   hosts.sh address HOST             # the host's address
#   hosts.sh down [NAME]              # kill their processes and remove everything `up` made
#
# Names are resolved inside the hosts through /etc/netns/HOST/hosts (ip netns exec mounts it over
# /etc/hosts), so `ff-2` reaches host 2 from every other host, and from nowhere else; on itself,
# as on Debian, a host's name is 127.0.1.1.
set -euo pipefail
self=$(readlink -f "$0")
subnet=10.231.0
prefix_len=24

die() { echo "hosts.sh: $*" >&2; exit 1; }
switch_of() { echo "$1-sw"; }
namespaces() { ip netns list | awk '{print $1}'; }
hosts_of() {  # the hosts made by `up NAME`, in order
  namespaces | grep -E "^$1-[0-9]+$" | sort -t- -k2 -n || true
}
hostfile_of() {  # an mpirun hostfile of the hosts NAME-*, SLOTS each
  local host
  for host in $(hosts_of "$1"); do echo "$host slots=$2"; done
}
number_of() { echo "${1##*-}"; }

check() {
  [ "$(id -u)" -eq 0 ] || die "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
  command -v ip >/dev/null || die "no 'ip' command (Debian: apt install iproute2)"
  command -v unshare >/dev/null || die "no 'unshare' command (Debian: util-linux)"
  local probe="ffprobe$$"
  ip netns add "$probe" 2>/dev/null || die "this machine refuses 'ip netns add' (no CAP_NET_ADMIN?)"
  local ok=1
  ip -n "$probe" link add br0 type bridge 2>/dev/null || ok=0
  ip link add "${probe}a" netns "$probe" type veth peer name "${probe}b" netns "$probe" \
    2>/dev/null || ok=0
  ip netns exec "$probe" unshare --uts true 2>/dev/null || ok=0
  ip netns del "$probe"
  [ "$ok" -eq 1 ] || die "namespaces can be made but not bridges, veth pairs or UTS namespaces"
}

up() {
  local n=$1 name=${2:-ff} switch i host
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "up: N must be 1..200"
  [[ "$name" =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "up: NAME must be 1-8 lower-case letters/digits"
  [ -z "$(hosts_of "$name")" ] || die "up: hosts $name-* exist already ('hosts.sh down $name')"
  check
  # Interrupted or failed half-way: remove what was made.
  trap 'down "$name"' EXIT
  trap 'exit 130' INT TERM
  switch=$(switch_of "$name")
  ip netns add "$switch"
  ip -n "$switch" link add sw type bridge
  ip -n "$switch" link set sw up
  mkdir -p /etc/netns
  local table
  table=$(for i in $(seq 1 "$n"); do printf '%s.%s %s-%s\n' "$subnet" "$i" "$name" "$i"; done)
  for i in $(seq 1 "$n"); do
    host="$name-$i"
    ip netns add "$host"
    ip link add "h$$x$i" netns "$host" type veth peer name "p$i" netns "$switch"
    ip -n "$host" link set "h$$x$i" name eth0
    ip -n "$host" addr add "$subnet.$i/$prefix_len" dev eth0
    ip -n "$host" link set lo up
    ip -n "$host" link set eth0 up
    ip -n "$switch" link set "p$i" master sw
    ip -n "$switch" link set "p$i" up
    mkdir -p "/etc/netns/$host"
    # As Debian's installer writes it, the host's own name is 127.0.1.1 (and only that): what
    # looks up its own name (Gloo's default device does) gets a loopback address, as on a real
    # Debian cluster. The other hosts' names give their addresses, as a cluster's DNS would.
    printf '127.0.0.1 localhost\n127.0.1.1 %s\n%s\n' "$host" "$(grep -v " $host\$" <<<"$table")" \
      >"/etc/netns/$host/hosts"
    echo "$host" >"/etc/netns/$host/hostname"
  done
  trap - EXIT INT TERM
  echo "hosts.sh: made $n hosts: $name-1 .. $name-$n ($subnet.1 .. $subnet.$n, switch $switch)"
}

down() {
  local name=${1:-ff} host switch
  switch=$(switch_of "$name")
  for host in $(hosts_of "$name"); do
    kill_host "$host"
    ip netns del "$host" 2>/dev/null || true
    rm -rf "/etc/netns/$host"
  done
  ip netns del "$switch" 2>/dev/null || true
}

kill_host() {
  local pids
  pids=$(ip netns pids "$1" 2>/dev/null || true)
  [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
}

run() {  # run HOST CMD...: inside HOST's network, with HOST as the hostname
  local host=$1; shift
  namespaces | grep -qx "$host" || die "no host '$host' (hosts.sh up)"
  exec ip netns exec "$host" unshare --uts /bin/sh -c 'hostname "$0" && exec "$@"' "$host" "$@"
}

resolve() {  # a host's name from a name or an address
  case $1 in
    "$subnet".*)
      local want=$1 host
      for host in $(namespaces | grep -E -- '-[0-9]+$'); do
        [ "$(address "$host")" = "$want" ] && { echo "$host"; return; }
      done
      die "no host has address $1" ;;
    *) echo "$1" ;;
  esac
}

address() { echo "$subnet.$(number_of "$1")"; }

case ${1:-} in
  check) check; echo "hosts.sh: this machine can make hosts from network namespaces" ;;
  up) shift; up "$@" ;;
  down) shift; down "$@" ;;
  hostfile) hostfile_of "${2:-ff}" "${3:-1}" ;;
  run) shift; run "$@" ;;
  agent)  # as ssh: the remote command arrives as words to join and give to a shell
    shift
    host=$(resolve "$1"); shift
    # Not exec: as ssh says "Connection to HOST closed", say which host's command ended how.
    set +e
    (run "$host" /bin/sh -c "$*")
    status=$?
    if [ "$status" -gt 128 ]; then
      echo "hosts.sh agent: the command on host $host ended by signal $((status - 128))" \
           "(its daemon and ranks: host lost)" >&2
    fi
    exit "$status" ;;
  mpirun)
    shift
    name=ff
    slots=1
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do
      case $1 in
        --per-host) slots=$2; shift 2 ;;
        *) name=$1; shift ;;
      esac
    done
    [ "${1:-}" = "--" ] && shift
    first=$(hosts_of "$name" | head -n1)
    [ -n "$first" ] || die "no hosts $name-* (hosts.sh up N $name)"
    hostfile=$(mktemp)
    trap 'rm -f "$hostfile"' EXIT
    hostfile_of "$name" "$slots" >"$hostfile"
    root=()
    [ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)
    # What a rank reads from its environment goes with it to every host (ssh would not carry it).
    export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
    forward=(-x OMP_WAIT_POLICY)
    for var in FIVEFOLD_BACKEND FIVEFOLD_COMM_TIMEOUT FIVEFOLD_THREADS MASTER_ADDR MASTER_PORT; do
      [ -z "${!var:-}" ] || forward+=(-x "$var")
    done
    if [ "${FIVEFOLD_BACKEND:-}" = gloo ] && [ -z "${MASTER_ADDR:-}" ]; then
      # Gloo meets at rank 0's host; the hosts' ports are their own, so any port is free there.
      forward+=(-x "MASTER_ADDR=$first" -x "MASTER_PORT=$((20000 + RANDOM % 20000))")
    fi
    # In a subshell (run execs): the trap removes the hostfile afterwards. The hosts share this machine's cores,
    # which Open MPI cannot know: a rank waiting for a message would spin on a core and starve
    # the kernel thread (ksoftirqd) that carries packets across the bridge, 4 ms a message
    # (measured); yielding when idle brings that to ~40 us.
    (run "$first" mpirun "${root[@]}" --hostfile "$hostfile" --mca plm_rsh_agent "$self agent" \
      --mca btl tcp,self --mca btl_tcp_if_include "$subnet.0/$prefix_len" \
      --mca oob_tcp_if_include "$subnet.0/$prefix_len" \
      --mca oob_tcp_keepalive_time 5 --mca oob_tcp_keepalive_intvl 2 \
      --mca oob_tcp_keepalive_probes 3 --mca mpi_yield_when_idle 1 "${forward[@]}" "$@") ;;
  link)
    [ $# -eq 3 ] || die "link HOST down|up"
    host=$2
    switch=$(switch_of "${host%-*}")
    ip -n "$switch" link set "p$(number_of "$host")" "$3"
    if [ "$3" = up ]; then
      # Addresses the hosts failed to resolve (ARP) while the cable was out stay "failed" for a
      # while and make new connections fail at once; forget them, as after a reboot.
      for other in $(hosts_of "${host%-*}"); do ip -n "$other" neigh flush dev eth0; done
      for _ in $(seq 1 100); do  # the kernel marks the host's end up a moment later
        ip -n "$host" link show eth0 | grep -q "state UP" && exit 0
        sleep 0.05
      done
      die "link: $host's eth0 is not up 5 s after its cable was plugged"
    fi ;;
  kill) kill_host "$2" ;;
  address) address "$2" ;;
  *) sed -n '2,25p' "$self" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
