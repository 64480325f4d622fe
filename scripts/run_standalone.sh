#!/usr/bin/env bash
# Train on one device, without msrun (parallel.data_parallel is set to 1; on CPU pinned to one core;
# MindSpore's own log at errors, GLOG_v=3, unless GLOG_v is set).
#
#   bash scripts/run_standalone.sh CONFIG [--set key=value ...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"
exec "$mindscale_python" -m mindscale.launch standalone "$@"
