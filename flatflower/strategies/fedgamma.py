"""FedGAMMA server (Dai et al. 2023): SCAFFOLD's (strategies/scaffold.py); the SAM gradient
lives on the clients."""

from __future__ import annotations

from flatflower.strategies.scaffold import Scaffold


class FedGAMMA(Scaffold):
    """Broadcasts the control variate c (2 models down, 2 up)."""
