"""MindScale's library: what run_train.py, tools/ and scripts/ are made of.

Each module imports only those listed below it (docs/design.md's layer order, which
tests/unit/test_imports.py checks):

    launch    msrun plans, the worker supervisor, MindSpore's dry run
    train     the train step, trainer, optimizer, schedule, data, checkpoints
    perf      FLOPs, the memory/time planner, run-folder readers, the GEMM peak
    models/   (beside this package) GPT, LLaMA and Qwen2
    cli       the one-line parser and errors every command shares; progress: long work on stderr
    io        atomic writes, folders committed with a checksum marker
    config    every key, its validation, and the Layout derived from the parallel keys (the leaf)

docs/design.md draws the flow from a YAML file to a compiled graph.
"""
