"""How a federation runs: the engines (engines/: the in-process grid, Flower's Ray simulation,
a real SuperLink and SuperNodes on loopback), the vectorised trainer (vectorized.py), the warm
ClientApp worker every SuperNode of a local deployment runs (worker.py), and certificate
generation for TLS (certs.py). It imports nothing of the user's commands (tools/), which are a
thin layer over it (tests/test_imports.py holds that).
"""
