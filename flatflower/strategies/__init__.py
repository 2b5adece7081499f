"""The server halves of the algorithms and the Flower strategy that drives them.

Each algorithm's server rule is a ``ServerRule`` over named tensors (base.py), one file per
algorithm (``strategies/<name>.py``, with the keys it reads), importing no Flower module.
``FlatStrategy`` (strategy.py) is the one Flower strategy that runs every algorithm's rounds,
with the partition handshake and message exchange (participation.py), the check of every reply
(validation.py), the mean and the robust aggregators (aggregate.py) and a model's buffers kept
apart from the rules (buffers.py). registry.py joins each server half to its client half
(client/algorithms/) and names the records that go down and up."""
