"""Small torch models that ship with the library, so demos, tests and benchmarks send a model
class every endpoint already has (``fl`` is installed there) instead of a class by value.

Importing this module imports torch: only FL code paths that build a model do so.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

__all__ = ["MLP"]


class MLP(nn.Module):
    """``in_features -> hidden... -> num_classes`` with ReLU; the digits default is 64-64-10."""

    def __init__(self, in_features: int = 64, hidden: Sequence[int] = (64,), num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = int(in_features)
        for h in hidden:
            layers += [nn.Linear(width, int(h)), nn.ReLU()]
            width = int(h)
        layers.append(nn.Linear(width, int(num_classes)))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))
