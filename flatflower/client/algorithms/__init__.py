"""Client halves of the algorithms (one small file each); joined to their server halves in strategies/registry.py."""
