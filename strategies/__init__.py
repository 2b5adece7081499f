"""Server halves of the algorithms: Flower strategies on one shared base (see base.py)."""
