"""FedLESAM servers (Fan et al., ICML 2024): the estimate of the global perturbation lives on
the clients, so each variant's server is that of the method it builds on: FedLESAM's is
FedAvg's, FedLESAM-D's FedDyn's, FedLESAM-S's SCAFFOLD's."""

from __future__ import annotations

from flatflower.strategies.fedavg import FedAvg
from flatflower.strategies.feddyn import FedDyn
from flatflower.strategies.scaffold import Scaffold


class FedLESAM(FedAvg):
    """1 model down, 1 up."""


class FedLESAMD(FedDyn):
    """FedDyn's server dual (1 model down, 1 up)."""


class FedLESAMS(Scaffold):
    """Broadcasts the control variate c (2 models down, 2 up)."""
