"""The algorithms: run-config name -> server half, client half and what crosses the wire.

An algorithm ``x`` has its server half in ``strategies/x.py`` and its client half in
``client/algorithms/x.py`` (a ``-`` in the name is a ``_`` in the file: dp-fedsam is
``dp_fedsam.py``); the families of :data:`FAMILIES` share one file per half, named
after the family (fedgmt.py holds fedgmt and fedgmt-v2).

Each half declares the run-config keys it reads (its ``Params``, common/params.py); the
registry joins them into the algorithm's params class and registers those with the run-config
parser (flatflower.common.config.register_algorithms), so the ground floor checks every key without
importing upward. This module sees both halves; every entry point imports it (the ServerApp
and the ClientApp, the engines, the CLI). The 28 built-ins are listed here; an algorithm of the user's own code is
named by a reference, ``algorithm = "package.module:callable"`` (a callable returning an
:class:`AlgorithmSpec`), and :func:`load` checks it and registers it under that reference the first
time a run config names it, in every process that parses one (docs/own-algorithm.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flatflower.client.algorithms.base import ClientRule
from flatflower.client.rule_state import RuleStateError, check_declared_state
from flatflower.client.algorithms.dp_fedsam import DPFedSAMClient
from flatflower.client.algorithms.fedacg import FedACGClient
from flatflower.client.algorithms.fedasam import FedASAMClient
from flatflower.client.algorithms.fedavg import FedAvgClient
from flatflower.client.algorithms.fedcm import FedCMClient
from flatflower.client.algorithms.feddyn import FedDynClient
from flatflower.client.algorithms.fedgamma import FedGAMMAClient
from flatflower.client.algorithms.fedgf import FedGFClient
from flatflower.client.algorithms.fedgloss import FedGloSSClient
from flatflower.client.algorithms.fedgmt import FedGMTClient, FedGMTv2Client
from flatflower.client.algorithms.fedlesam import FedLESAMClient, FedLESAMDClient, FedLESAMSClient
from flatflower.client.algorithms.fedmoswa import FedMoSWAClient
from flatflower.client.algorithms.fednsam import FedNSAMClient
from flatflower.client.algorithms.fedopt import FedOptClient
from flatflower.client.algorithms.fedprox import FedProxClient
from flatflower.client.algorithms.fedsam import FedSAMClient
from flatflower.client.algorithms.fedsmoo import FedSMOOClient
from flatflower.client.algorithms.fedsol import FedSOLClient
from flatflower.client.algorithms.fedswa import FedSWAClient
from flatflower.client.algorithms.fedspeed import FedSpeedClient
from flatflower.client.algorithms.fedtoga import FedTOGAClient
from flatflower.client.algorithms.fedwmsam import FedWMSAMClient
from flatflower.client.algorithms.mofedsam import MoFedSAMClient
from flatflower.client.algorithms.scaffold import ScaffoldClient
from flatflower.common import protocol as P
from flatflower.common.config import algorithm_fields, general_fields, register_algorithms
from flatflower.common.params import Params, combine, is_required
from flatflower.common.references import BadReference, call, is_reference, resolve
from flatflower.strategies.base import ServerRule
from flatflower.strategies.compatibility import compatibility_problems
from flatflower.strategies.dp_fedsam import DPFedSAM
from flatflower.strategies.fedacg import FedACG
from flatflower.strategies.fedasam import FedASAM
from flatflower.strategies.fedavg import FedAvg
from flatflower.strategies.fedcm import FedCM
from flatflower.strategies.feddyn import FedDyn
from flatflower.strategies.fedgamma import FedGAMMA
from flatflower.strategies.fedgf import FedGF
from flatflower.strategies.fedgloss import FedGloSS
from flatflower.strategies.fedgmt import FedGMT, FedGMTv2
from flatflower.strategies.fedlesam import FedLESAM, FedLESAMD, FedLESAMS
from flatflower.strategies.fedmoswa import FedMoSWA
from flatflower.strategies.fednsam import FedNSAM
from flatflower.strategies.fedopt import FedAdam, FedYogi
from flatflower.strategies.fedprox import FedProx
from flatflower.strategies.fedsam import FedSAM
from flatflower.strategies.fedsmoo import FedSMOO
from flatflower.strategies.fedsol import FedSOL
from flatflower.strategies.fedswa import FedSWA
from flatflower.strategies.fedspeed import FedSpeed
from flatflower.strategies.fedtoga import FedTOGA
from flatflower.strategies.fedwmsam import FedWMSAM
from flatflower.strategies.mofedsam import MoFedSAM
from flatflower.strategies.scaffold import Scaffold
from flatflower.strategies.strategy import FlatStrategy


# family file -> the algorithms whose halves it holds (strategies/<file>.py, client/algorithms/<file>.py)
FAMILIES = {"fedgmt": ("fedgmt", "fedgmt-v2"), "fedlesam": ("fedlesam", "fedlesam-d", "fedlesam-s"),
            "fedopt": ("fedadam", "fedyogi")}


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm: its two halves (``server``, a ServerRule; ``client``, a ClientRule) and
    which records cross the wire.

    ``down``/``up`` list the records besides the model (``arrays``), the ``config`` and
    ``metrics`` records that every message carries; ``values`` the scalars the server sends in
    a train message's config (FedGF's c); ``state`` the records a client keeps between its
    rounds. ``passes`` is the number of gradient (forward + backward) passes per
    local step with the default config, ``forwards`` the extra forward-only passes (FedGMT's
    teacher): what ``flatflower bench`` measures against. ``params`` (derived) holds the keys
    of both halves.
    """

    name: str
    server: type[ServerRule]
    client: type[ClientRule]
    down: tuple[str, ...] = ()
    up: tuple[str, ...] = ()
    values: tuple[str, ...] = ()
    state: tuple[str, ...] = ()
    passes: int = 1
    forwards: int = 0
    summary: str = ""
    params: type[Params] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for half, base in (("server", ServerRule), ("client", ClientRule)):
            cls = getattr(self, half)
            if not (isinstance(cls, type) and issubclass(cls, base)):
                raise TypeError(f"AlgorithmSpec {self.name!r}: {half} is {cls!r}, not a subclass of "
                                f"flatflower.{base.__name__}")
        keys = combine(f"{self.server.__name__}Keys", self.server.Params, self.client.Params)
        object.__setattr__(self, "params", keys)

    def new_rule(self, cfg, initial_model, num_partitions: int | None = None) -> ServerRule:
        """The server rule for run config ``cfg`` (its ``algorithm`` is this one), over N =
        ``num_partitions`` clients: pure tensor code, no Flower."""
        return self.server(cfg, initial_model, self, num_partitions)

    def new_strategy(self, cfg, initial_model, **kwargs: Any) -> FlatStrategy:
        """The Flower strategy that drives this algorithm's rounds for run config ``cfg``."""
        return FlatStrategy(cfg, initial_model, self, **kwargs)

    def example_config(self) -> dict[str, Any]:
        """The run config of this algorithm with its required keys (FedGF's T_D) set to their
        example values: what runs every algorithm (``flatflower bench``, the tests) uses."""
        return {"algorithm": self.name, **self.params.examples()}

    def key_owners(self) -> dict[str, str]:
        """Each of this algorithm's run-config keys -> which half reads it: server, client or both."""
        server, client = self.server.Params.fields(), self.client.Params.fields()
        return {k: "both" if k in server and k in client else "server" if k in server else "client"
                for k in self.params.fields()}


ALGORITHMS: dict[str, AlgorithmSpec] = {
    spec.name: spec
    for spec in (
        AlgorithmSpec("fedavg", FedAvg, FedAvgClient,
                      summary="FedAvg (McMahan et al. 2017) with a server learning rate"),
        AlgorithmSpec("fedsam", FedSAM, FedSAMClient, passes=2,
                      summary="FedSAM (Qu et al. 2022, eq. 4): local SAM, FedAvg server"),
        AlgorithmSpec("mofedsam", MoFedSAM, MoFedSAMClient, down=(P.GLOBAL_UPDATE,), passes=2,
                      summary="MoFedSAM (Qu et al. 2022, eq. 6): local SAM mixed with the global update"),
        AlgorithmSpec("fedcm", FedCM, FedCMClient, down=(P.GLOBAL_UPDATE,),
                      summary="FedCM (Xu et al. 2021): local gradients mixed with the global update"),
        AlgorithmSpec("feddyn", FedDyn, FedDynClient, state=(P.DUAL,),
                      summary="FedDyn (Acar et al. 2021): dynamic regulariser, client and server duals"),
        AlgorithmSpec("fedspeed", FedSpeed, FedSpeedClient, state=(P.DUAL,), passes=2,
                      summary="FedSpeed (Sun et al. 2023): FedDyn's prox-correction around local SAM"),
        AlgorithmSpec("fedgmt", FedGMT, FedGMTClient, down=(P.EMA_MODEL,), state=(P.DUAL,), forwards=1,
                      summary="FedGMT (Li et al. 2025): KL to the server's EMA model + ADMM duals"),
        AlgorithmSpec("fedgmt-v2", FedGMTv2, FedGMTv2Client, state=(P.DUAL, P.CLIENT_EMA), forwards=1,
                      summary="FedGMT-v2 (Li et al. 2025): FedGMT with a client-side EMA, 1x communication"),
        AlgorithmSpec("fednsam", FedNSAM, FedNSAMClient, down=(P.MOMENTUM,),
                      summary="FedNSAM (Liu et al. 2025): server Nesterov momentum as look-ahead and perturbation"),
        AlgorithmSpec("fedtoga", FedTOGA, FedTOGAClient, down=(P.GLOBAL_UPDATE,), state=(P.DUAL,), passes=2,
                      summary="FedTOGA (Li et al.): SAM perturbation corrected by the global update, dual correction"),
        # the baselines the papers compare against
        AlgorithmSpec("fedprox", FedProx, FedProxClient,
                      summary="FedProx (Li et al. 2020): proximal term (mu/2)||w - w^t||^2, FedAvg server"),
        AlgorithmSpec("scaffold", Scaffold, ScaffoldClient, down=(P.CONTROL,), up=(P.CONTROL_DELTA,),
                      state=(P.CLIENT_CONTROL,),
                      summary="SCAFFOLD (Karimireddy et al. 2020): control variates, option II"),
        AlgorithmSpec("fedgamma", FedGAMMA, FedGAMMAClient, down=(P.CONTROL,), up=(P.CONTROL_DELTA,),
                      state=(P.CLIENT_CONTROL,), passes=2,
                      summary="FedGAMMA (Dai et al. 2023): SCAFFOLD control variates around local SAM"),
        AlgorithmSpec("fedsmoo", FedSMOO, FedSMOOClient, down=(P.GLOBAL_PERTURBATION,),
                      up=(P.PERTURBATION_CORRECTION,), state=(P.DUAL, P.PERTURBATION_DUAL), passes=2,
                      summary="FedSMOO (Sun et al. 2023): corrected SAM perturbation towards a global one, FedDyn duals"),
        AlgorithmSpec("fedlesam", FedLESAM, FedLESAMClient, state=(P.PREVIOUS_GLOBAL,),
                      summary="FedLESAM (Fan et al. 2024): perturbation from the client's previous global model, 1 pass"),
        AlgorithmSpec("fedlesam-d", FedLESAMD, FedLESAMDClient, state=(P.DUAL, P.PREVIOUS_GLOBAL),
                      summary="FedLESAM-D (Fan et al. 2024): FedLESAM on FedDyn"),
        AlgorithmSpec("fedlesam-s", FedLESAMS, FedLESAMSClient, down=(P.CONTROL,), up=(P.CONTROL_DELTA,),
                      state=(P.CLIENT_CONTROL, P.PREVIOUS_GLOBAL),
                      summary="FedLESAM-S (Fan et al. 2024): FedLESAM on SCAFFOLD"),
        AlgorithmSpec("fedacg", FedACG, FedACGClient,
                      summary="FedACG (Kim et al. 2024): look-ahead server momentum broadcast, prox to it"),
        AlgorithmSpec("fedasam", FedASAM, FedASAMClient, passes=2,
                      summary="FedASAM (Caldarola et al. 2022): local adaptive SAM (ASAM), FedAvg server"),
        AlgorithmSpec("fedadam", FedAdam, FedOptClient,
                      summary="FedAdam (Reddi et al. 2021): Adam on the server over the mean update"),
        AlgorithmSpec("fedyogi", FedYogi, FedOptClient,
                      summary="FedYogi (Reddi et al. 2021): Yogi on the server over the mean update"),
        # methods published since the seed papers
        AlgorithmSpec("fedsol", FedSOL, FedSOLClient, passes=2, forwards=1,
                      summary="FedSOL (Lee et al. 2024): SAM ascent along a proximal KL to the received model"),
        AlgorithmSpec("fedgloss", FedGloSS, FedGloSSClient, values=(P.LOCAL_RADIUS,), state=(P.DUAL,), passes=2,
                      summary="FedGloSS (Caldarola et al. 2025): server-side SAM from the last pseudo-gradient, ADMM duals"),
        AlgorithmSpec("fedswa", FedSWA, FedSWAClient,
                      summary="FedSWA (Liu et al. 2025): cyclical in-round lr (SWA), server step alpha = server-lr"),
        AlgorithmSpec("fedmoswa", FedMoSWA, FedMoSWAClient, down=(P.MOMENTUM_CONTROL,), up=(P.CONTROL_OFFSET,),
                      state=(P.CLIENT_CONTROL,),
                      summary="FedMoSWA (Liu et al. 2025): FedSWA with a momentum control variate (SCAFFOLD-like)"),
        AlgorithmSpec("fedgf", FedGF, FedGFClient, down=(P.PERTURBED_GLOBAL,), values=(P.MIX_WEIGHT,), passes=2,
                      summary="FedGF (Lee & Yoon 2024): local SAM point pulled towards a perturbed global model"),
        AlgorithmSpec("fedwmsam", FedWMSAM, FedWMSAMClient, down=(P.GLOBAL_UPDATE, P.CONTROL),
                      values=(P.LOCAL_WEIGHT,), state=(P.CLIENT_CONTROL,),
                      summary="FedWMSAM (Li et al. 2025): momentum + SCAFFOLD correction, one-pass SAM to a momentum target"),
        AlgorithmSpec("dp-fedsam", DPFedSAM, DPFedSAMClient, passes=2,
                      summary="DP-FedSAM (Shi et al. 2023): local SAM/ASAM with client-level DP (the dp.* keys)"),
    )
}
BUILT_IN = tuple(ALGORITHMS)  # the 28 names; a user's algorithm is registered under its reference
# the records every message carries besides an algorithm's own (common/protocol.py)
RESERVED_RECORDS = ("arrays", "config", "metrics")


def get(name: str) -> AlgorithmSpec:
    """The spec of ``name``: a built-in, or a user's algorithm named by its reference
    (:func:`load`); ValueError listing the valid names, or saying why the reference is unusable."""
    if name not in ALGORITHMS and is_reference(name):
        return load(name)
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; valid names: {', '.join(sorted(ALGORITHMS))}, or a reference "
            "package.module:callable to your own (docs/own-algorithm.md)"
        ) from None


def load(reference: str) -> AlgorithmSpec:
    """The user's algorithm ``reference`` names (``package.module:callable``, returning an
    :class:`AlgorithmSpec`), checked (:func:`spec_problems`) and registered under the reference,
    which is then its name everywhere (run config, config.json, checkpoints, report).
    :class:`~flatflower.common.references.BadReference` (a ValueError) in one line when it
    cannot be used."""
    if reference in ALGORITHMS:
        return ALGORITHMS[reference]
    make = resolve(reference, "algorithm")
    spec = make if isinstance(make, AlgorithmSpec) else call(make, (), "algorithm", reference)
    if not isinstance(spec, AlgorithmSpec):
        raise BadReference(f"algorithm={reference!r} returned a {type(spec).__name__}, not a "
                           "flatflower.AlgorithmSpec")
    problems = spec_problems(spec)
    if problems:
        raise BadReference(f"algorithm={reference!r}: {'; '.join(problems)}")
    try:  # the client half keeps what it declares (its Keeps), found now and not mid-run
        check_declared_state(spec.client, down=spec.down, values=spec.values, state=spec.state)
    except RuleStateError as err:
        raise BadReference(f"algorithm={reference!r}: {err}") from None
    spec = dataclasses.replace(spec, name=reference)
    ALGORITHMS[reference] = spec
    register_algorithms({reference: spec.params})
    return spec


def spec_problems(spec: AlgorithmSpec) -> list[str]:
    """What makes ``spec`` unusable, one phrase each (empty: nothing): halves that are not a
    ServerRule and a ClientRule, a server half without an update, record names that clash,
    run-config keys outside a namespace or clashing with the general keys or with another
    algorithm's key of another default, bad search ranges, bad pass counts. Every built-in passes."""
    problems = []
    if not (isinstance(spec.server, type) and issubclass(spec.server, ServerRule)):
        problems.append(f"server is {spec.server!r}, not a subclass of flatflower.ServerRule")
    elif spec.server.update is ServerRule.update:
        problems.append(f"{spec.server.__name__} does not implement update()")
    if not (isinstance(spec.client, type) and issubclass(spec.client, ClientRule)):
        problems.append(f"client is {spec.client!r}, not a subclass of flatflower.ClientRule")
    named = {"down": spec.down, "up": spec.up, "values": spec.values, "state": spec.state}
    for what, names in named.items():
        bad = [n for n in names if not isinstance(n, str) or not n or n in RESERVED_RECORDS]
        if bad or len(set(names)) != len(names):
            problems.append(f"{what} names {list(names)} must be distinct non-empty texts other than "
                            f"{', '.join(RESERVED_RECORDS)}")
    sent = [*spec.down, *spec.values]
    if len(set(sent)) != len(sent):
        problems.append(f"down {list(spec.down)} and values {list(spec.values)} share a name")
    if not (isinstance(spec.passes, int) and spec.passes >= 1 and isinstance(spec.forwards, int) and spec.forwards >= 0):
        problems.append(f"passes must be an integer >= 1 and forwards >= 0 (got {spec.passes!r}, {spec.forwards!r})")
    general = general_fields()
    others = {k: f for k, (_, f) in algorithm_fields().items()} if ALGORITHMS else {}
    for k, f in spec.params.fields().items():
        if "." not in k:
            problems.append(f"key {k!r} needs a namespace (e.g. myalgo.{k})")
        elif k in general:
            problems.append(f"key {k!r} is a general run-config key")
        elif k in others and (others[k].default != f.default and not (is_required(others[k]) and is_required(f))
                              or others[k].type != f.type):
            problems.append(f"key {k!r} is another algorithm's, with another default or type "
                            f"({others[k].default!r}); choose a namespace of your own")
        search = f.metadata.get("search")
        if search is not None and search.problem():
            problems.append(f"key {k!r}: {search.problem()}")
    return problems


register_algorithms({name: spec.params for name, spec in ALGORITHMS.items()},
                    compatibility=lambda cfg: compatibility_problems(cfg, get(cfg.algorithm)),
                    loader=load)


def search_data(search) -> dict | None:
    """A key's search range (flatflower tune) as data; None for a key that is not tuned."""
    return None if search is None else {"low": search.low, "high": search.high, "log": search.log,
                                        "integer": search.integer}


def as_data(specs: Sequence[AlgorithmSpec] | None = None) -> list[dict]:
    """The registry as data (``flatflower algorithms --json``): per algorithm its name, summary,
    keys (name, default, meaning, which half reads it, its search range for a tune), records down/up, client state, passes
    per step and the class of each half."""
    out = []
    for spec in specs or ALGORITHMS.values():
        owners = spec.key_owners()
        out.append({
            "name": spec.name, "summary": spec.summary,
            "keys": [{"name": k, "default": None if is_required(f) else f.default,
                      "required": is_required(f), "meaning": f.metadata["meaning"], "read_by": owners[k],
                      "search": search_data(f.metadata.get("search"))}
                     for k, f in spec.params.fields().items()],
            "down": list(spec.down), "values": list(spec.values), "up": list(spec.up),
            "state": list(spec.state),
            "passes": spec.passes, "forwards": spec.forwards,
            "server": f"{spec.server.__module__}.{spec.server.__qualname__}",
            "client": f"{spec.client.__module__}.{spec.client.__qualname__}",
        })
    return out
