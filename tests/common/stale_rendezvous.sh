#!/usr/bin/env bash
# A Gloo job under mpirun meets in $TMPDIR/fivefold-rendezvous-<job>-<launcher pid>; a job that
# crashed leaves its file. The next job removes files whose launcher no longer exists, keeps those
# of running launchers, and removes its own when it ends cleanly.
# Usage: stale_rendezvous.sh <fivefold binary>
set -u
program=$1
export TMPDIR=$(mktemp -d)
trap 'rm -rf "$TMPDIR"' EXIT
touch "$TMPDIR/fivefold-rendezvous-4242-999999"  # a launcher pid that does not exist
touch "$TMPDIR/fivefold-rendezvous-4343-1"       # pid 1 runs: a job that may still be alive
FIVEFOLD_BACKEND=gloo mpirun --oversubscribe -np 2 -x TMPDIR "$program" info || exit 1
left=$(ls "$TMPDIR")
echo "left in TMPDIR: $left"
[ "$left" = "fivefold-rendezvous-4343-1" ] || { echo "FAIL: expected only the live job's file"; exit 1; }
