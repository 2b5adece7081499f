"""Algorithm registry: run-config name -> server half, client half and wire protocol.

Adding an algorithm = its strategy file, its client file, its tests and one line here.
Halves are named as ``"module:Class"`` strings and imported lazily, so a client never
imports server code and vice versa.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from common import protocol as P


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm: where its two halves live and which records cross the wire.

    ``down``/``up`` list the records besides the model (``arrays``), the ``config``
    and ``metrics`` records that every message carries.
    """

    name: str
    strategy: str
    client: str
    down: tuple[str, ...] = ()
    up: tuple[str, ...] = ()
    summary: str = ""

    def strategy_class(self) -> type:
        return _load(self.strategy)

    def client_class(self) -> type:
        return _load(self.client)


def _load(path: str) -> type:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


ALGORITHMS: dict[str, AlgorithmSpec] = {
    spec.name: spec
    for spec in (
        AlgorithmSpec("fedavg", "strategies.fedavg:FedAvg", "client.algorithms.fedavg:FedAvgClient",
                      summary="FedAvg (McMahan et al. 2017) with a server learning rate"),
        AlgorithmSpec("fedsam", "strategies.fedsam:FedSAM", "client.algorithms.fedsam:FedSAMClient",
                      summary="FedSAM (Qu et al. 2022, eq. 4): local SAM, FedAvg server"),
        AlgorithmSpec("mofedsam", "strategies.mofedsam:MoFedSAM",
                      "client.algorithms.mofedsam:MoFedSAMClient", down=(P.GLOBAL_UPDATE,),
                      summary="MoFedSAM (Qu et al. 2022, eq. 6): local SAM mixed with the global update"),
    )
}


def get(name: str) -> AlgorithmSpec:
    """The spec of ``name``, or a ValueError listing the valid names."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; valid names: {', '.join(sorted(ALGORITHMS))}"
        ) from None
