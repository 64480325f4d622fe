#!/usr/bin/env bash
# Train on all devices of this node (and of NNODES nodes) through msrun.
#
#   bash scripts/run_distribute.sh CONFIG [NUM_DEVICES] [--set key=value ...] [--max-restarts N] [--dry-run]
#
# NUM_DEVICES: workers on this node (default: every visible NPU/GPU; 2 on a CPU host, each pinned
# to its own cores). When given, parallel.data_parallel is set so that data x model x pipeline
# parallel = NNODES x NUM_DEVICES. Multi-node: export MASTER_ADDR (node 0), MASTER_PORT, NNODES
# and NODE_RANK on every node, as for msrun. Logs: <run.output_dir>/<run.name>/logs/worker_<rank>.log
# (this node's first worker's is followed on the console; everything msrun printed is in
# logs/msrun_node_<NODE_RANK>.log). A dead worker stops the job at once; the exit status is
# non-zero and the last line names that worker's log. SIGTERM/SIGUSR1 stops gracefully: every rank
# finishes its step and saves a committed checkpoint, exit 0 (again, or Ctrl+C: at once).
# --max-restarts N (run.max_restarts): relaunch every worker from the newest committed checkpoint after
# a failure, at most N times (one node only). A rank silent for run.hang_timeout_s is named, its
# Python stacks dumped into its log, and the job stopped. See docs/launch.md.
# --dry-run prints the msrun command instead.
# MINDSCALE_ENTRY=path/to/script.py replaces run_train.py (testing and debugging); see docs/launch.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"
exec "$mindscale_python" -m mindscale.launch distribute "$@"
