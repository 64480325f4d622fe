"""Training, by what a reader looks for: loop/ (the trainer and its compiled step), data/, checkpoints/,
resilience/ (health, heartbeat, graceful stop); inference.py generates text from a checkpoint."""
