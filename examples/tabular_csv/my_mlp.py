"""A multilayer perceptron for tabular data: ``--model model:mlp``.

flatflower calls ``mlp(input_shape, num_classes)``; a CSV dataset's input shape is
(number of feature columns,).
"""

from torch import nn


def mlp(input_shape, num_classes):
    (features,) = input_shape
    return nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, num_classes))
