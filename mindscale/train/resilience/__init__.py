"""Surviving faults: health guards, the heartbeat, graceful stop, test-only fault hooks."""
