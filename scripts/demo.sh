#!/usr/bin/env bash
# The embedded demo (`make demo`): no download. Text already on every machine (the Python standard
# library's sources) -> SentencePiece tokenizer -> MindRecord (5% of the files held out) -> 2-worker
# data-parallel pretraining of configs/tiny/llama_tiny.yaml through scripts/run_distribute.sh, with a
# validation loss every 50 steps -> MFU of the run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD
DATA=${DEMO_DATA:-output/demo_data}
STDLIB=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
CORPUS=("$STDLIB"/*.py "$STDLIB"/json/*.py "$STDLIB"/email/*.py)

rm -rf output/demo  # the demo always trains from scratch
mkdir -p "$DATA"
if [ ! -f "$DATA/tokenizer.model" ]; then
  echo "== tokenizer: SentencePiece BPE, vocab 2048, on ${#CORPUS[@]} stdlib files"
  $PY tools/train_tokenizer.py --input "${CORPUS[@]}" --vocab-size 2048 --output "$DATA/tokenizer"
fi
if [ ! -f "$DATA/mindrecord/valid/manifest.json" ]; then
  echo "== preprocess: pack into 129-token samples (MindRecord), 5% of the files held out for validation"
  $PY tools/preprocess_data.py --config configs/tiny/llama_tiny.yaml --input "${CORPUS[@]}" \
      --tokenizer "$DATA/tokenizer.model" --valid-fraction 0.05 --output "$DATA/mindrecord" --overwrite
fi

echo "== train: 2 CPU workers, data parallel"
bash scripts/run_distribute.sh configs/tiny/llama_tiny.yaml 2 \
    --set run.name=demo --set data.path="$DATA/mindrecord" --set data.tokenizer="$DATA/tokenizer.model" \
    --set data.valid_path="$DATA/mindrecord/valid" --set train.eval_interval=50 --set train.eval_steps=8 "$@"

RUN=output/demo
echo "== MFU of the run (tools/mfu.py, from metrics.jsonl)"
$PY tools/mfu.py --metrics "$RUN" --devices 2
echo "Run folder: $RUN (config.yaml, metrics.jsonl, checkpoints/, logs/)"
