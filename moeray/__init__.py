"""moeray: serve Mixture-of-Experts GGUF models on a Ray cluster of unequal GPUs.

The package's parts live in the repository's top-level folders and install as subpackages:
moeray.stages (what runs inside one stage), moeray.cache (the expert cache), moeray.planner
(pure placement search: no torch, no Ray) and moeray.cluster (driver, engine, server, CLI).
"""
__version__ = "0.1.0"
