"""Training: the compiled train step, the trainer loop, optimizer, schedule, data and checkpoints."""
