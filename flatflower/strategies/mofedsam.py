"""MoFedSAM server (Qu et al. 2022, Alg. 2): FedCM's server (see flatflower.strategies.fedcm); the
difference from FedCM is the clients' SAM gradient."""

from __future__ import annotations

from flatflower.strategies.fedcm import FedCM


class MoFedSAM(FedCM):
    """Broadcasts the global update Delta (2 models down, 1 up)."""
