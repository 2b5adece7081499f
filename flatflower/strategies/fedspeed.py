"""FedSpeed server (Sun et al. 2023): the FedDyn server, with the duals averaged over all N
clients as in the authors' code (FL-Simulator issue #6); SAM lives on the clients."""

from __future__ import annotations

from flatflower.strategies.feddyn import FedDyn


class FedSpeed(FedDyn):
    """1 model down, 1 up."""
