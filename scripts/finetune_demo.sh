#!/usr/bin/env bash
# `make finetune-demo`: supervised fine-tuning of the demo's pretrained tiny LLaMA on instruction
# data built from stdlib docstrings (prompt tokens masked out of the loss), then generation.
# Runs `make demo` first when its checkpoint is missing. Writes output/tiny_sft/ (the run folder)
# and output/demo_data/sft/ (the SFT data); says where at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD
DATA=output/demo_data
RUN=output/tiny_sft
[ -d output/demo/checkpoints/step_00000200 ] || bash scripts/demo.sh

echo "== SFT data: Alpaca records from stdlib docstrings, alpaca template, prompt tokens masked"
$PY scripts/sft_from_docstrings.py --output "$DATA/sft.jsonl"
$PY tools/preprocess_data.py --mode sft --template alpaca --input "$DATA/sft.jsonl" \
    --tokenizer "$DATA/tokenizer.model" --seq-length 128 --output "$DATA/sft" --overwrite

echo "== fine-tune from output/demo/checkpoints/step_00000200 (configs/finetune/tiny_sft.yaml)"
rm -rf "$RUN"
bash scripts/run_standalone.sh configs/finetune/tiny_sft.yaml "$@"
STEP=$(ls -d "$RUN"/checkpoints/step_* | tail -n 1)  # the last step, whatever train.steps was set to

echo "== generate (greedy, KV cache; the config is the step's own config.yaml)"
$PY tools/generate.py --load_checkpoint "$STEP" --prompt "What does os.path.join do?" --max_new_tokens 40 --greedy

echo "Run folder: $RUN (config.yaml, metrics.jsonl, logs/); fine-tuned weights: $STEP"
echo "SFT data: $DATA/sft.jsonl (records) and $DATA/sft (MindRecord)"
echo "Generate again:          $PY tools/generate.py --load_checkpoint $STEP --prompt 'What does os.path.join do?' --max_new_tokens 40 --greedy"
echo "Export for transformers: $PY tools/convert_checkpoint.py --direction ms2hf --input $STEP --output ${RUN}_hf"
