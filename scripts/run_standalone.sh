#!/usr/bin/env bash
# Train on one device, without msrun (parallel.data_parallel is set to 1).
#
#   bash scripts/run_standalone.sh CONFIG [--set key=value ...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"
exec "$mindscale_python" -m mindscale.launch standalone "$@"
