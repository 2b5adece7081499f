"""Loss and accuracy of a model on a data split (server test set or a client's data)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flatflower.common.datasets import Split


@torch.no_grad()
def evaluate(model: nn.Module, data: Split, batch_size: int = 512) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on ``data``."""
    device = next(model.parameters()).device
    model.eval()
    total_loss, correct = 0.0, 0
    for start in range(0, len(data), batch_size):
        x, y = data.get(slice(start, start + batch_size))
        x, y = x.to(device), y.to(device)
        logits = model(x)
        total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
    n = max(len(data), 1)
    return total_loss / n, correct / n
