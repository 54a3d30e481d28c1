"""Scale-out: which data-parallel replica a request with an image goes to (``routing.py``) and the
tensor-parallel collective and agreement behind every plan (``tensor_parallel.py``)."""
