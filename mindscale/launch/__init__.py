"""Launching: msrun plans and the worker supervisor (plan), MindSpore's dry run and its CANN stand-ins."""
