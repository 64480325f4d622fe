#!/usr/bin/env bash
# Multi-node training over ssh: one scripts/run_distribute.sh (one msrun) per host.
#
#   bash scripts/run_hostfile.sh HOSTFILE CONFIG [NUM_DEVICES] [--set key=value ...] [--dry-run]
#
# HOSTFILE: one host name or address per line ('#' starts a comment), each host once; the first host
# is node 0 and runs the msrun scheduler, so MASTER_ADDR defaults to it (export MASTER_ADDR to use another
# address of that host). MASTER_PORT defaults to 8118. Every host needs password-less ssh, the
# repository at this same path and this working directory (a shared file system), because the
# command runs there as `cd $PWD && NODE_RANK=i bash <repo>/scripts/run_distribute.sh ...`.
# --dry-run prints the ssh commands instead of running them. Exit status: the first failing
# node's (each node's launcher stops its workers when a peer dies).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"

usage="scripts/run_hostfile.sh HOSTFILE CONFIG [NUM_DEVICES] [--set key=value ...] [--dry-run]"
(( $# >= 2 )) || mindscale_fail "usage: $usage"
hostfile=$1
shift
[[ -f $hostfile ]] || mindscale_fail "hostfile $hostfile does not exist; pass a file with one host per line"

hosts=()
while IFS= read -r line || [[ -n $line ]]; do
  line=${line%%#*}
  read -r -a fields <<< "$line"
  if (( ${#fields[@]} == 0 )); then continue; fi
  (( ${#fields[@]} == 1 )) ||
    mindscale_fail "hostfile $hostfile: '${line}' has more than a host name; write one host per line"
  hosts+=("${fields[0]}")
done < "$hostfile"
(( ${#hosts[@]} > 0 )) || mindscale_fail "hostfile $hostfile lists no hosts; write one host per line"
# One node per host: msrun on a host that is MASTER_ADDR starts a scheduler, so a host listed twice
# starts two and MindSpore fails with "Failed to initialize distributed job cluster".
declare -A node_of=()
for rank in "${!hosts[@]}"; do
  host=${hosts[$rank]}
  [[ -z ${node_of[$host]:-} ]] || mindscale_fail "hostfile $hostfile lists $host twice (nodes ${node_of[$host]} and" \
    "$rank): a host runs one node; list it once and give its worker count as NUM_DEVICES"
  node_of[$host]=$rank
done

dry_run=0
args=()
for arg in "$@"; do
  if [[ $arg == --dry-run ]]; then dry_run=1; else args+=("$arg"); fi
done

forward=(MASTER_ADDR="${MASTER_ADDR:-${hosts[0]}}" MASTER_PORT="${MASTER_PORT:-8118}" NNODES="${#hosts[@]}")
for name in PYTHON MINDSCALE_ENTRY MINDSCALE_CLUSTER_TIMEOUT; do
  if [[ -n ${!name:-} ]]; then forward+=("$name=${!name}"); fi
done

pids=()
for rank in "${!hosts[@]}"; do
  remote="cd $(printf '%q' "$PWD") && env $(printf '%q ' "${forward[@]}" "NODE_RANK=$rank")bash"
  remote+=" $(printf '%q' "$MINDSCALE_ROOT/scripts/run_distribute.sh")$(printf ' %q' "${args[@]}")"
  cmd=(ssh -n -o BatchMode=yes "${hosts[$rank]}" "$remote")
  if (( dry_run )); then
    echo "ssh -n -o BatchMode=yes ${hosts[$rank]} ${remote@Q}"
  else
    "${cmd[@]}" &
    pids+=($!)
  fi
done

status=0
for rank in "${!pids[@]}"; do
  if wait "${pids[$rank]}"; then continue; else code=$?; fi
  echo "error: node $rank (${hosts[$rank]}) exited with code $code; its log lines are above" >&2
  if (( status == 0 )); then status=$code; fi
done
exit "$status"
