"""The policy layer on other runtimes: ``transformers.py`` runs the same methods on a plain
transformers model (the offline reference the serving results are compared with)."""
