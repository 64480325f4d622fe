"""The training loop: the compiled step, the trainer, optimizer, schedule, validation, runtime, logs."""
