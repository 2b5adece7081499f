"""DP-FedSAM server (Shi et al., CVPR 2023): FedSAM's, i.e. the FedAvg server; SAM lives on the
clients, DP in the clients' uploads (common/privacy.py)."""

from __future__ import annotations

from flatflower.strategies.fedsam import FedSAM


class DPFedSAM(FedSAM):
    """The FedAvg server over the clients' clipped, noised updates (uniform mean: ``aggregation
    = uniform`` is required with ``dp.clip > 0``)."""
