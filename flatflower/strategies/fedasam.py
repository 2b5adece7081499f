"""FedASAM server (Caldarola et al. 2022): the FedAvg server; ASAM lives on the clients."""

from __future__ import annotations

from flatflower.strategies.fedsam import FedSAM


class FedASAM(FedSAM):
    """Same server rule and communication as FedAvg (1 model down, 1 up)."""
