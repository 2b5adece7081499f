"""FedSWA server (Liu et al., ICML 2025; notes §1, §3-4): the FedAvg server,
w <- w + alpha sum_i p_i (w_i - w), alpha = ``server-lr`` (the paper's "EMA" aggregation; its
ablation favours alpha = 1.5). The SWA part is the clients' in-round lr. FedMoSWA's server
(strategies/fedmoswa.py) extends this one.
"""

from __future__ import annotations

from flatflower.strategies.fedavg import FedAvg


class FedSWA(FedAvg):
    """Same server rule and communication as FedAvg (1 model down, 1 up)."""
