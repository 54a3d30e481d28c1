"""Small repository tools, run from the repository root (``python -m tools.config_doc``)."""
