"""Checkpoints: the step folder, its commit by every rank, resharding, and the trainer's Checkpointer."""
