"""An algorithm's halves for a user's own Flower apps: its server half as a Flower strategy
(:func:`server_strategy`, a ``FlatStrategy``: ``strategy.start(...)`` in the user's ServerApp)
and its client half as one round of local training (:func:`local_training`, in the user's
ClientApp), plus the list of algorithms (:func:`algorithms`), from the registry
(strategies/registry.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flatflower.common.config import ConfigError, RunConfig, flat_keys


def algorithms() -> list[dict[str, Any]]:
    """Every algorithm as data (what ``flatflower algorithms --json`` prints): ``name``,
    ``summary``, ``keys`` (each: ``name``, ``default``, ``required``, ``meaning``, ``read_by``),
    the records it sends ``down`` and ``up``, its scalar ``values``, its client ``state``, its
    gradient ``passes`` (and extra ``forwards``) per local step, and its two halves' classes."""
    from flatflower.strategies.registry import as_data

    return as_data()


def _config(algorithm: str, config: Mapping[str, Any] | RunConfig | None, keys: Mapping[str, Any]) -> RunConfig:
    """The run config of ``algorithm``: ``config`` (run-config keys, or a RunConfig), then
    ``keys`` (``local_epochs=1`` is ``local-epochs``). ConfigError when ``config`` names
    another algorithm (a ClientApp reading that run config would run the other one's half)."""
    values = config.to_dict() if isinstance(config, RunConfig) else flat_keys(dict(config or {}))
    values.update({k.replace("_", "-"): v for k, v in keys.items()})
    if values.get("algorithm", algorithm) != algorithm:
        raise ConfigError(f"algorithm={algorithm!r} disagrees with the config's algorithm="
                          f"{values['algorithm']!r} (flatflower's ClientApp reads the run config)")
    return RunConfig.from_mapping({**values, "algorithm": algorithm})


def server_strategy(algorithm: str, config: Mapping[str, Any] | RunConfig | None = None, *,
                    initial_model: nn.Module | Mapping[str, torch.Tensor] | None = None, **keys: Any):
    """``algorithm``'s server half as a Flower strategy (a message-API ``FedAvg`` subclass,
    strategies/strategy.py) to ``start()`` in your own ServerApp::

        strategy = flatflower.server_strategy("fedgmt", context.run_config)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(strategy.model), num_rounds=3)

    ``initial_model``: an ``nn.Module`` or a state dict (default: the run's model built from its
    ``model``, ``dataset`` and ``seed``, as the ServerApp builds it). Its clients run the same
    algorithm's client half: flatflower's ClientApp (``flatflower.client_app``) with this run
    config (``strategy.cfg.to_dict()``). The strategy holds the global model
    (``strategy.model``), its server state and what the last round did
    (``strategy.round_record()``)."""
    from flatflower.common.data import model_shape, partitions_for
    from flatflower.common.models import buffer_names, build_model
    from flatflower.strategies.registry import get

    cfg = _config(algorithm, config, keys)
    if initial_model is None:
        input_shape, num_classes = model_shape(cfg)
        initial_model = build_model(cfg.resolved_model(), input_shape, num_classes, seed=cfg.seed)
    buffers = buffer_names(initial_model) if isinstance(initial_model, nn.Module) else []
    state = initial_model.state_dict() if isinstance(initial_model, nn.Module) else initial_model
    from collections import OrderedDict

    state = OrderedDict((k, v.detach().clone()) for k, v in state.items())
    sizes = None if cfg.local_data() else (lambda n: [len(p) for p in partitions_for(cfg, n)])
    return get(algorithm).new_strategy(cfg, state, partition_sizes=sizes, buffers=buffers)


@dataclass(frozen=True)
class TrainingResult:
    """One round of local training: the examples and steps it took, its mean loss, the records
    the algorithm uploads besides the model (named tensors; none for a model-only
    algorithm) and the client's new state (to pass as ``state`` next round)."""

    num_examples: int
    num_steps: int
    mean_loss: float
    uploads: dict[str, dict[str, torch.Tensor]]
    state: dict[str, dict[str, torch.Tensor]]


def local_training(algorithm: str, model: nn.Module, data: Any,
                   config: Mapping[str, Any] | RunConfig | None = None, *,
                   broadcast: Mapping[str, Any] | None = None, state: Mapping[str, Any] | None = None,
                   server_round: int = 1, partition_id: int = 0, **keys: Any) -> TrainingResult:
    """``algorithm``'s client half: one round of its local training of ``model`` (in place,
    holding the received global weights) on ``data`` (a ``flatflower.common.datasets.Split`` or ``(x,
    y)``: inputs as the model takes them, integer labels), as flatflower's own ClientApp
    trains it (client/train.py): the same steps, mini-batches (seeded by ``seed``,
    ``server_round`` and ``partition_id``), learning rate and augmentation. ``config``:
    run-config keys (lr, local-epochs, batch-size, sam.rho, ...). A model-only algorithm (FedAvg,
    FedSAM, FedProx, ...) needs nothing more; others take the server's ``broadcast`` records
    (name -> state dict, and their scalars) and this client's ``state`` (from the last
    result's)."""
    from flatflower.client.train import build_rule, local_train, round_generator, rule_outputs
    from flatflower.common.augment import train_augment
    from flatflower.common.datasets import Split
    from flatflower.strategies.registry import get

    cfg = _config(algorithm, config, keys)
    spec = get(algorithm)
    if cfg.dp_clip > 0:
        raise ConfigError("local_training does not privatize the update (dp.clip > 0): clip and noise it "
                          "yourself (common/privacy.py), or run flatflower's ClientApp")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model is a {type(model).__name__}, not a torch.nn.Module")
    broadcast, state = dict(broadcast or {}), dict(state or {})
    missing = [n for n in (*spec.down, *spec.values) if n not in broadcast]
    if missing:
        raise ValueError(f"{algorithm} needs the server's {', '.join(missing)} in broadcast "
                         "(its records down: flatflower.algorithms())")
    unknown = sorted(set(state) - set(spec.state))
    if unknown:
        raise ValueError(f"state holds {', '.join(unknown)}, which {algorithm} does not keep "
                         f"({', '.join(spec.state) or 'no client state'})")
    if not isinstance(data, Split):
        if not (isinstance(data, (tuple, list)) and len(data) == 2):
            raise ValueError(f"data is a {type(data).__name__}: give (x, y) or a flatflower.common.datasets.Split")
        data = Split(torch.as_tensor(data[0]), torch.as_tensor(data[1]).long())
    lr = cfg.round_lr(server_round)
    rule, layout = build_rule(spec, cfg, model, broadcast, state, lr)
    augment = train_augment(cfg.train_transform, cfg.seed, server_round, partition_id)
    result = local_train(model, data, rule, cfg, lr, round_generator(cfg.seed, server_round, partition_id),
                         lambda idx: data.get(idx, augment=augment))
    uploads, new_state = rule_outputs(rule, layout, model)
    return TrainingResult(result.num_examples, result.num_steps, result.mean_loss, uploads, new_state)
