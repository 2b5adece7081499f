"""Which algorithm goes with which options: every algorithm x option rule, said once.

The run config checks each key on its own and the options among themselves (common/config.py:
dp.clip > 0 needs aggregation = uniform, ...); an algorithm's own keys are checked by its params
(common/params.py). What is left is what depends on both an algorithm's protocol and the
general options, such as client-level DP, which clips and noises the model update only. The
registry hands :func:`compatibility_problems` to the run-config parser, so every run config
that is built (the CLI's, the ServerApp's, a ClientApp's) is refused, one line, before anything
starts; nothing else says these rules again.
"""

from __future__ import annotations


def compatibility_problems(cfg, spec) -> list[str]:
    """What is wrong with running the algorithm ``spec`` (strategies/registry.py) under run
    config ``cfg`` (its general options), as one-line problems."""
    problems = []
    if cfg.dp_clip > 0:  # client-level DP (common/privacy.py): the uniform mean of the model updates
        if spec.up:
            problems.append(f"dp.clip > 0: {spec.name} uploads {', '.join(spec.up)} besides the model, and "
                            "client-level DP here clips and noises the model update only; use an algorithm "
                            "whose only upload is the model (FedAvg, FedSAM, FedProx, ...)")
        elif why := spec.server.dp_refusal(cfg):
            problems.append(f"dp.clip > 0: {spec.name}: {why}")
    return problems
