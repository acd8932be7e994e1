#!/usr/bin/env bash
# A Gloo job under mpirun meets in $TMPDIR/fivefold-rendezvous-<job>-<launcher pid>-<launcher
# start time>; a job that crashed leaves its file. The next job removes files whose launcher no
# longer runs or whose pid now belongs to a later process, keeps those of running launchers, and
# removes its own when it ends cleanly.
# Usage: stale_rendezvous.sh <fivefold binary>
set -u
program=$1
export TMPDIR=$(mktemp -d)
trap 'rm -rf "$TMPDIR"' EXIT
init_start=$(awk '{ sub(/.*\) /, ""); print $20 }' /proc/1/stat)  # field 22 of pid 1's stat
touch "$TMPDIR/fivefold-rendezvous-ompi-4242-999999-5"             # a pid that does not exist
touch "$TMPDIR/fivefold-rendezvous-ompi-4444-1-$((init_start + 1))"  # pid 1, but a later process
touch "$TMPDIR/fivefold-rendezvous-ompi-4343-1-$init_start"        # pid 1 itself: may be alive
touch "$TMPDIR/fivefold-notes"                                     # not a rendezvous file
FIVEFOLD_BACKEND=gloo mpirun --oversubscribe -np 2 -x TMPDIR "$program" info || exit 1
left=$(ls "$TMPDIR" | tr '\n' ' ')
echo "left in TMPDIR: $left"
[ "$left" = "fivefold-notes fivefold-rendezvous-ompi-4343-1-$init_start " ] ||
  { echo "FAIL: expected only the live job's file and the unrelated one"; exit 1; }
