"""FedAdam and FedYogi (Reddi et al., ICLR 2021, Alg. 2): the clients run FedAvg
(client.algorithms.fedavg); these are the server's hyperparameters (strategies/fedopt.py),
kept here beside the client half as every algorithm's params are."""

from __future__ import annotations

from dataclasses import dataclass

from common.params import FRACTION, POSITIVE, Params, key


@dataclass(frozen=True)
class FedOptParams(Params):
    eta: float = key("fedopt.eta", 0.01, "server step size eta (server-lr is not used)", POSITIVE)
    beta1: float = key("fedopt.beta1", 0.9, "first-moment decay beta1", FRACTION)
    beta2: float = key("fedopt.beta2", 0.99, "second-moment decay beta2", FRACTION)
    tau: float = key("fedopt.tau", 0.001, "adaptivity tau", POSITIVE)

    def problems(self, cfg) -> list[str]:
        out = super().problems(cfg)
        if cfg.server_lr != 1.0:
            out.append(f"server-lr={cfg.server_lr} has no effect on {cfg.algorithm}: its server "
                       "step size is fedopt.eta")
        return out
