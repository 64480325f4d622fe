#!/usr/bin/env bash
# `make finetune-demo`: supervised fine-tuning of the demo's pretrained tiny LLaMA on instruction
# data built from stdlib docstrings (prompt tokens masked out of the loss), then generation.
# Runs `make demo` first when its checkpoint is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD
DATA=output/demo_data
[ -d output/demo/checkpoints/step_00000200 ] || bash scripts/demo.sh

echo "== SFT data: Alpaca records from stdlib docstrings, alpaca template, prompt tokens masked"
$PY scripts/sft_from_docstrings.py --output "$DATA/sft.jsonl"
$PY tools/preprocess_data.py --mode sft --template alpaca --input "$DATA/sft.jsonl" \
    --tokenizer "$DATA/tokenizer.model" --seq-length 128 --output "$DATA/sft" --overwrite

echo "== fine-tune from output/demo/checkpoints/step_00000200 (configs/finetune/tiny_sft.yaml)"
rm -rf output/tiny_sft
bash scripts/run_standalone.sh configs/finetune/tiny_sft.yaml "$@"

echo "== generate (greedy, KV cache)"
$PY tools/generate.py --config configs/finetune/tiny_sft.yaml \
    --load_checkpoint output/tiny_sft/checkpoints/step_00000060 \
    --prompt "What does os.path.join do?" --max_new_tokens 40 --greedy
