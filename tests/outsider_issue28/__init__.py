"""Outsider checks of issue 28 (the multiprocessing layer: start-now, cancel, lease, 'c' ctypes)."""
