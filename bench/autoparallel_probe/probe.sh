#!/bin/bash
# usage: probe.sh NAME CONFIG [extra args...]  -> compiles the twin both ways
set -u
name=$1; config=$2; shift 2
cd "$(git rev-parse --show-toplevel)"
for api in ${ORDER:-context cell}; do
  rm -rf /tmp/ap/ir/${name}_$api
  start=$(date +%s)
  if [ $api = cell ]; then export MINDSCALE_PARALLEL_API=cell; else unset MINDSCALE_PARALLEL_API; fi
  MINDSCALE_PROBE_CTX=/tmp/ap/ctx/$name PYTHONPATH=$PWD LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \
    nice -n 5 .venv/bin/python tools/dryrun.py --config $config --jobs 1 --json --ir-dir /tmp/ap/ir/${name}_$api \
    --log-dir /tmp/ap/log/${name}_$api "$@" > /tmp/ap/${name}_$api.json 2> /tmp/ap/${name}_$api.err
  echo "$name $api rc=$? wall=$(( $(date +%s) - start ))s"
done
unset MINDSCALE_PARALLEL_API
.venv/bin/python bench/autoparallel_probe/compare.py $name
