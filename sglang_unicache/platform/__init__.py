"""Platforms: the out-of-tree CPU platform that runs the real SGLang engine with no GPU."""
