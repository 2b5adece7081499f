"""Algorithm registry: run-config name -> server half, client half, params and wire protocol.

Adding an algorithm = its params and client half (client/algorithms/), its server half
(strategies/, unless it reuses one), its tests and one entry here (CONTRIBUTING.md). Halves
and params are named as ``"module:Class"`` strings and imported lazily; params live beside
the client half, so a client never imports server code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from common import protocol as P


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm: where its two halves live and which records cross the wire.

    ``down``/``up`` list the records besides the model (``arrays``), the ``config``
    and ``metrics`` records that every message carries; ``state`` the records a client keeps
    between its rounds. ``passes`` is the number of gradient (forward + backward) passes per
    local step with the default config, ``forwards`` the extra forward-only passes (FedGMT's
    teacher): what ``flatflower bench`` measures against.
    """

    name: str
    strategy: str
    client: str
    params: str = "common.params:Params"  # the algorithm's hyperparameters (common/params.py)
    down: tuple[str, ...] = ()
    up: tuple[str, ...] = ()
    state: tuple[str, ...] = ()
    passes: int = 1
    forwards: int = 0
    summary: str = ""

    def strategy_class(self) -> type:
        return _load(self.strategy)

    def client_class(self) -> type:
        return _load(self.client)

    def params_class(self) -> type:
        return _load(self.params)


def _load(path: str) -> type:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


ALGORITHMS: dict[str, AlgorithmSpec] = {
    spec.name: spec
    for spec in (
        AlgorithmSpec("fedavg", "strategies.fedavg:FedAvg", "client.algorithms.fedavg:FedAvgClient",
                      summary="FedAvg (McMahan et al. 2017) with a server learning rate"),
        AlgorithmSpec("fedsam", "strategies.fedsam:FedSAM", "client.algorithms.fedsam:FedSAMClient",
                      params="client.sam:SAMParams",
                      passes=2,
                      summary="FedSAM (Qu et al. 2022, eq. 4): local SAM, FedAvg server"),
        AlgorithmSpec("mofedsam", "strategies.mofedsam:MoFedSAM",
                      "client.algorithms.mofedsam:MoFedSAMClient",
                      params="client.algorithms.mofedsam:MoFedSAMParams", down=(P.GLOBAL_UPDATE,),
                      passes=2,
                      summary="MoFedSAM (Qu et al. 2022, eq. 6): local SAM mixed with the global update"),
        AlgorithmSpec("fedcm", "strategies.fedcm:FedCM", "client.algorithms.fedcm:FedCMClient",
                      params="client.algorithms.fedcm:FedCMParams",
                      down=(P.GLOBAL_UPDATE,),
                      summary="FedCM (Xu et al. 2021): local gradients mixed with the global update"),
        AlgorithmSpec("feddyn", "strategies.feddyn:FedDyn", "client.algorithms.feddyn:FedDynClient",
                      params="client.algorithms.feddyn:DualParams",
                      state=(P.DUAL,),
                      summary="FedDyn (Acar et al. 2021): dynamic regulariser, client and server duals"),
        AlgorithmSpec("fedspeed", "strategies.fedspeed:FedSpeed",
                      "client.algorithms.fedspeed:FedSpeedClient",
                      params="client.algorithms.fedspeed:FedSpeedParams",
                      state=(P.DUAL,), passes=2,
                      summary="FedSpeed (Sun et al. 2023): FedDyn's prox-correction around local SAM"),
        AlgorithmSpec("fedgmt", "strategies.fedgmt:FedGMT", "client.algorithms.fedgmt:FedGMTClient",
                      params="client.algorithms.fedgmt:FedGMTParams",
                      down=(P.EMA_MODEL,),
                      state=(P.DUAL,), forwards=1,
                      summary="FedGMT (Li et al. 2025): KL to the server's EMA model + ADMM duals"),
        AlgorithmSpec("fedgmt-v2", "strategies.fedgmt:FedGMTv2",
                      "client.algorithms.fedgmt:FedGMTv2Client",
                      params="client.algorithms.fedgmt:FedGMTv2Params",
                      state=(P.DUAL, P.CLIENT_EMA), forwards=1,
                      summary="FedGMT-v2 (Li et al. 2025): FedGMT with a client-side EMA, 1x communication"),
        AlgorithmSpec("fednsam", "strategies.fednsam:FedNSAM", "client.algorithms.fednsam:FedNSAMClient",
                      params="client.algorithms.fednsam:FedNSAMParams",
                      down=(P.MOMENTUM,),
                      summary="FedNSAM (Liu et al. 2025): server Nesterov momentum as look-ahead and perturbation"),
        AlgorithmSpec("fedtoga", "strategies.fedtoga:FedTOGA", "client.algorithms.fedtoga:FedTOGAClient",
                      params="client.algorithms.fedtoga:FedTOGAParams",
                      down=(P.GLOBAL_UPDATE,),
                      state=(P.DUAL,), passes=2,
                      summary="FedTOGA (Li et al.): SAM perturbation corrected by the global update, dual correction"),
        # the baselines the papers compare against
        AlgorithmSpec("fedprox", "strategies.fedavg:FedAvg", "client.algorithms.fedprox:FedProxClient",
                      params="client.algorithms.fedprox:FedProxParams",
                      summary="FedProx (Li et al. 2020): proximal term (mu/2)||w - w^t||^2, FedAvg server"),
        AlgorithmSpec("scaffold", "strategies.scaffold:Scaffold", "client.algorithms.scaffold:ScaffoldClient",
                      down=(P.CONTROL,), up=(P.CONTROL_DELTA,),
                      state=(P.CLIENT_CONTROL,),
                      summary="SCAFFOLD (Karimireddy et al. 2020): control variates, option II"),
        AlgorithmSpec("fedgamma", "strategies.scaffold:Scaffold", "client.algorithms.scaffold:FedGAMMAClient",
                      params="client.sam:SAMParams",
                      down=(P.CONTROL,), up=(P.CONTROL_DELTA,),
                      state=(P.CLIENT_CONTROL,), passes=2,
                      summary="FedGAMMA (Dai et al. 2023): SCAFFOLD control variates around local SAM"),
        AlgorithmSpec("fedsmoo", "strategies.fedsmoo:FedSMOO", "client.algorithms.fedsmoo:FedSMOOClient",
                      params="client.algorithms.fedsmoo:FedSMOOParams",
                      down=(P.GLOBAL_PERTURBATION,), up=(P.PERTURBATION_CORRECTION,),
                      state=(P.DUAL, P.PERTURBATION_DUAL), passes=2,
                      summary="FedSMOO (Sun et al. 2023): corrected SAM perturbation towards a global one, FedDyn duals"),
        AlgorithmSpec("fedlesam", "strategies.fedavg:FedAvg", "client.algorithms.fedlesam:FedLESAMClient",
                      params="client.algorithms.fedlesam:FedLESAMParams",
                      state=(P.PREVIOUS_GLOBAL,),
                      summary="FedLESAM (Fan et al. 2024): perturbation from the client's previous global model, 1 pass"),
        AlgorithmSpec("fedlesam-d", "strategies.feddyn:FedDyn", "client.algorithms.fedlesam:FedLESAMDClient",
                      params="client.algorithms.fedlesam:FedLESAMDParams",
                      state=(P.DUAL, P.PREVIOUS_GLOBAL),
                      summary="FedLESAM-D (Fan et al. 2024): FedLESAM on FedDyn"),
        AlgorithmSpec("fedlesam-s", "strategies.scaffold:Scaffold", "client.algorithms.fedlesam:FedLESAMSClient",
                      params="client.algorithms.fedlesam:FedLESAMParams",
                      down=(P.CONTROL,), up=(P.CONTROL_DELTA,),
                      state=(P.CLIENT_CONTROL, P.PREVIOUS_GLOBAL),
                      summary="FedLESAM-S (Fan et al. 2024): FedLESAM on SCAFFOLD"),
        AlgorithmSpec("fedacg", "strategies.fedacg:FedACG", "client.algorithms.fedprox:FedACGClient",
                      params="client.algorithms.fedprox:FedACGParams",
                      summary="FedACG (Kim et al. 2024): look-ahead server momentum broadcast, prox to it"),
        AlgorithmSpec("fedasam", "strategies.fedsam:FedSAM", "client.algorithms.fedasam:FedASAMClient",
                      params="client.algorithms.fedasam:FedASAMParams", passes=2,
                      summary="FedASAM (Caldarola et al. 2022): local adaptive SAM (ASAM), FedAvg server"),
        AlgorithmSpec("fedadam", "strategies.fedopt:FedAdam", "client.algorithms.fedavg:FedAvgClient",
                      params="client.algorithms.fedopt:FedOptParams",
                      summary="FedAdam (Reddi et al. 2021): Adam on the server over the mean update"),
        AlgorithmSpec("fedyogi", "strategies.fedopt:FedYogi", "client.algorithms.fedavg:FedAvgClient",
                      params="client.algorithms.fedopt:FedOptParams",
                      summary="FedYogi (Reddi et al. 2021): Yogi on the server over the mean update"),
    )
}


def algorithm_keys() -> dict[str, object]:
    """Every algorithm's run-config keys -> their defaults (a key shared by a family, such as
    ``sam.rho``, has one default)."""
    return {k: f.default for k, (_, f) in algorithm_fields().items()}


def algorithm_fields() -> dict[str, tuple[type, object]]:
    """Every algorithm's run-config keys -> (a params class that declares it, its field)."""
    out: dict[str, tuple[type, object]] = {}
    for spec in ALGORITHMS.values():
        cls = spec.params_class()
        for k, f in cls.fields().items():
            out.setdefault(k, (cls, f))
    return out


def get(name: str) -> AlgorithmSpec:
    """The spec of ``name``, or a ValueError listing the valid names."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; valid names: {', '.join(sorted(ALGORITHMS))}"
        ) from None
