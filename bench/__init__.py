"""`make bench`: MindScale against MindFormers and Hugging Face/torch on this machine (BENCHMARKS.md).

Nothing here imports a framework or numpy: bench_train.py pins its process to one core before any
thread pool starts.
"""

SYSTEMS = ("mindscale", "mindformers", "hf")
