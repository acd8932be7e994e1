# Sourced by the tests that start ranks torchrun's way (MASTER_PORT). pick_port prints a TCP port
# for their rendezvous: below the kernel's ephemeral range, where Gloo's own listeners and every
# outgoing connection of the tests running beside this one take theirs, and not one that anything
# on this machine listens on now. A port can still be taken between the choice and the bind, so
# the callers retry when a rank says the port is in use.
pick_port() {
  local low=32768 high=60999 bottom=20000 top port _
  read -r low high _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true
  top=$((low - 1))
  if [ "$top" -lt $((bottom + 1000)) ]; then  # a low ephemeral range: use the ports above it
    bottom=$((high + 1))
    top=65535
  fi
  for _ in $(seq 1 50); do
    port=$((bottom + RANDOM % (top - bottom + 1)))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "$port"
      return 0
    fi
  done
  echo "pick_port: no free port found between $bottom and $top" >&2
  return 1
}
