"""Models with BatchNorm for the buffer tests, referenced as ``tests.bn_models:<name>`` (the
run-config ``model`` key's ``package.module:callable`` form)."""

from __future__ import annotations

from torch import nn


def small_bn_cnn(input_shape, num_classes):
    """conv - BatchNorm - ReLU - linear: the smallest model with every kind of buffer (float
    running mean and variance, the int64 ``num_batches_tracked``)."""
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(c, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * h * w, num_classes))


def resnet18_bn(input_shape, num_classes):
    """torchvision's ResNet-18 with its BatchNorm, the stem adapted to small inputs (3x3 conv
    of stride 1, no max pooling), as the CIFAR papers' ResNet-18s do."""
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(input_shape[0], 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    return model
