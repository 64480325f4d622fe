"""The byte sizes the planner counts in."""

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MOMENT_BYTES = 4  # AdamW's moments are fp32 whatever param_dtype (mindscale/train/loop/optim.py)
