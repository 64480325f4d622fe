"""MindScale's library: what run_train.py, tools/ and scripts/ are made of.

Each module imports only those listed above it (config, the leaf, first):

    config   every key, its validation, and the Layout derived from the parallel keys (a leaf)
    io       atomic writes, folders committed with a checksum marker
    models/  (beside this package) GPT and LLaMA; imports only config and io
    perf     FLOPs, the memory/time planner, run-folder readers, the GEMM peak
    train    the train step, trainer, optimizer, schedule, data, checkpoints
    launch   msrun plans, the worker supervisor, MindSpore's dry run
    cli      the one-line parser and errors every command shares

docs/design.md draws the flow from a YAML file to a compiled graph.
"""
