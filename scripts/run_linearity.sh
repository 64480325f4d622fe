#!/usr/bin/env bash
# Linearity sweep: run one config at each device count, then tabulate and plot the linearity.
#
#   bash scripts/run_linearity.sh CONFIG "1 2 4 8" [--set k=v ...]
#
# Each count N runs `scripts/run_distribute.sh CONFIG N --set run.name=<name>_n<N> ...`; the
# launcher sets parallel.data_parallel to match N. train.micro_batch_size is kept, so the
# per-device batch is the same at every N and the global batch grows with N (docs/mfu.md);
# train.global_batch_size is reset to null for that. Checkpoints are not written (a sweep measures
# speed); your --set options win over that default. On CPU "a device" is one worker pinned to
# one core (the launcher pins them): on a 2-core machine only "1 2" is meaningful.
# Then tools/linearity.py reads the run folders, prints the table and writes
# <output_dir>/<name>_linearity.png and a linearity.json in each run folder.
# Exit: 0 done, 2 bad input, otherwise the failing step's status.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"

[ $# -ge 2 ] || mindscale_fail "usage: bash scripts/run_linearity.sh CONFIG \"1 2 4 8\" [--set k=v ...]"
CONFIG="$1"
COUNTS="$2"
shift 2

read -r -a counts <<< "$COUNTS"
[ "${#counts[@]}" -ge 2 ] || mindscale_fail "device counts \"$COUNTS\": give at least two, e.g. \"1 2\""
for n in "${counts[@]}"; do
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || mindscale_fail "device count \"$n\" is not a positive integer; e.g. \"1 2 4 8\""
done
[ "$(printf '%s\n' "${counts[@]}" | sort -u | wc -l)" -eq "${#counts[@]}" ] ||
    mindscale_fail "device counts \"$COUNTS\" repeat a value; list each count once"

# The run name and output folder after the user's overrides (exits 2 on a bad config).
names="$("$mindscale_python" - "$CONFIG" "$@" <<'EOF'
import argparse, sys
from mindscale.cli import add_config_arguments, config_from_args
parser = argparse.ArgumentParser(prog="run_linearity.sh")
add_config_arguments(parser)
args = parser.parse_args(["--config", sys.argv[1], *sys.argv[2:]])
cfg = config_from_args(args)
print(cfg.run.name)
print(cfg.run.output_dir)
EOF
)"
NAME="$(sed -n 1p <<< "$names")"
OUTPUT_DIR="$(sed -n 2p <<< "$names")"

run_dirs=()
for n in "${counts[@]}"; do
    run_dir="$OUTPUT_DIR/${NAME}_n$n"
    [ ! -e "$run_dir" ] ||
        mindscale_fail "$run_dir exists (a resumed run would mix old and new steps); remove it or pass --set run.name=<new name>"
    run_dirs+=("$run_dir")
done

for n in "${counts[@]}"; do
    echo "== linearity sweep: $n device(s) -> $OUTPUT_DIR/${NAME}_n$n" >&2
    bash "$MINDSCALE_ROOT/scripts/run_distribute.sh" "$CONFIG" "$n" \
        --set checkpoint.save_interval=0 --set checkpoint.save_at_end=false "$@" \
        --set "run.name=${NAME}_n$n" --set train.global_batch_size=null
done

"$mindscale_python" "$MINDSCALE_ROOT/tools/linearity.py" "${run_dirs[@]}" \
    --plot "$OUTPUT_DIR/${NAME}_linearity.png"
