"""torchvision's ResNet-18, with its BatchNorm, as the CIFAR papers train it on small images.

flatflower calls ``resnet18(input_shape, num_classes)`` (``--model model:resnet18``) in every
process of the run: the server, and each client. The CIFAR variant replaces the ImageNet stem
(7x7 convolution, stride 2, max pooling) by a 3x3 convolution of stride 1 and no pooling, so a
32x32 image keeps its resolution into the first block.
"""

from torch import nn
from torchvision.models import resnet18 as torchvision_resnet18


def resnet18(input_shape, num_classes):
    channels = input_shape[0]
    model = torchvision_resnet18(weights=None, num_classes=num_classes)  # BatchNorm, as torchvision builds it
    model.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model
