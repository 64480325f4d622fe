"""Performance arithmetic: model FLOPs, the memory/time planner, run-folder readers, the GEMM peak."""
