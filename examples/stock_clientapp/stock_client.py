"""A stock-style Flower ClientApp that joins a flatflower run (docs/protocol.md).

Plain Flower and PyTorch, nothing of flatflower: its own model, its own data, its own training
loop. What it must do to be accepted by a flatflower server running a model-only algorithm
(fedavg, fedsam, fedprox, ...):

* ``query`` (the partition handshake): say how many examples it trains on (and holds out), and
  which partition it is, echoing the message's nonce;
* ``train``: load the received ``arrays``, take exactly the local steps the run config asks for
  (``local-steps``, else ``local-epochs`` passes of ceil(n / batch-size) batches), reply with the
  whole state dict, ``num-examples``, ``num-steps``, ``train-loss`` as metrics and
  ``partition-id`` + the echoed ``nonce`` in a ConfigRecord named ``config``;
* ``evaluate``: loss and accuracy of the received model on its held-out data.

Its model is flatflower's ``model = "logreg"`` for ``input-shape = "64"``, ``num-classes = 10``
(the same state-dict keys and shapes); its data is this node's slice of scikit-learn's digits
(bundled, offline): replace :func:`load_data` with your own.
"""

from __future__ import annotations

import math

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from sklearn.datasets import load_digits
from torch import nn

app = ClientApp()


def net() -> nn.Module:
    """flatflower's ``logreg`` for 64 features and 10 classes: keys 1.weight, 1.bias."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


def load_data(context: Context):
    """(train, held-out) of this node: every num-partitions-th digit from partition-id on,
    80% to train on, 20% held out."""
    pid, parts = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)
    mine = torch.arange(pid, len(y), parts)
    cut = int(0.8 * len(mine))
    return (x[mine[:cut]], y[mine[:cut]]), (x[mine[cut:]], y[mine[cut:]])


def identity(msg: Message, context: Context) -> ConfigRecord:
    """Which partition this node is, and the nonce of the message it answers."""
    return ConfigRecord({"partition-id": int(context.node_config["partition-id"]),
                         "nonce": int(msg.content["config"]["nonce"])})


@app.query()
def query(msg: Message, context: Context) -> Message:
    (_, y), (_, y_out) = load_data(context)
    metrics = MetricRecord({"num-partitions": int(context.node_config["num-partitions"]),
                            "num-examples": len(y), "num-heldout": len(y_out)})
    return Message(RecordDict({"metrics": metrics, "config": identity(msg, context)}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    run = context.run_config
    server_round = int(msg.content["config"]["server-round"])
    (x, y), _ = load_data(context)
    model = net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    batch = int(run["batch-size"])
    steps = int(run["local-steps"]) or int(run["local-epochs"]) * math.ceil(len(y) / batch)
    lr = float(run["lr"]) * float(run["lr-decay"]) ** (server_round - 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(server_round * 1000 + int(context.node_config["partition-id"]))
    losses = []
    while len(losses) < steps:  # passes over the data, each in a fresh order; the last batch may be smaller
        for idx in torch.randperm(len(y), generator=generator).split(batch)[:steps - len(losses)]:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    metrics = MetricRecord({"num-examples": len(y), "num-steps": steps,
                            "train-loss": sum(losses) / len(losses)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics,
                               "config": identity(msg, context)}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    _, (x, y) = load_data(context)
    model = net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    with torch.no_grad():
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(1) == y).float().mean().item()
    metrics = MetricRecord({"num-examples": len(y), "eval-loss": loss, "eval-accuracy": accuracy})
    return Message(RecordDict({"metrics": metrics, "config": identity(msg, context)}), reply_to=msg)
