"""Out-of-tree SGLang platforms: ``cpu/`` runs the real engine on a CPU (``unicache_cpu``)."""
