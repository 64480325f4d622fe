#!/bin/bash
cd "$(git rev-parse --show-toplevel)"
for spec in gpt3_125m:gpt3 gpt3_1.3b:gpt3 llama3_2_1b:llama3_2 llama3_2_3b:llama3_2 llama2_13b:llama2 qwen2_5_7b:qwen2 qwen2_5_14b:qwen2 qwen3_8b:qwen3 qwen3_14b:qwen3 qwen3_32b:qwen3 gpt3_13b:gpt3 llama2_70b:llama2 qwen2_5_32b:qwen2 qwen2_5_72b:qwen2 llama3_70b:llama3 llama3_1_70b_128k:llama3_1 llama3_405b:llama3 deepseek_v3_671b:deepseek_v3 qwen3_30b_a3b:qwen3_moe qwen3_235b_a22b:qwen3_moe gpt3_175b:gpt3 gpt_1t:gpt3 llama3_8b_sft:finetune+ qwen2_5_7b_sft:finetune+ llama2_7b_sft:finetune+ llama2_70b_sft:finetune+; do
  name=${spec%%:*}; dir=${spec#*:}; extra="--twin"
  if [[ $dir == *+ ]]; then dir=${dir%+}; extra="--twin --packed"; fi
  if [ $(date +%H%M) -ge 2058 ]; then echo "STOP at $name (deadline)"; break; fi
  bench/autoparallel_probe/probe.sh $name configs/$dir/$name.yaml $extra 2>&1 | grep -v "ascend_config\|^  context keys"
done
echo SWEEP DONE $(date -u)
