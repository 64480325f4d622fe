"""MindScale's library: what run_train.py, tools/ and scripts/ are made of.

Its packages, and the order in which they may import each other, are docs/design.md's "Layers"
(tests/unit/test_imports.py checks that order).
"""
