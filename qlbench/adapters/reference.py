"""Reference rows that do not train: they show how far the shift moved (`frozen`) and what learning nothing scores
(`mean`), so that a collapsed method is visible in every table."""

from __future__ import annotations

import torch
import torch.nn as nn

from qlbench.adapters.base import Method


class Frozen(Method):
    name = "frozen"
    summary = "the source-pretrained backbone evaluated on the target, no training"
    kind = "reference"
    trains = False

    def build(self, backbone, config, generators, y_train):
        for p in backbone.parameters():
            p.requires_grad_(False)
        return backbone


class MeanPredictor(nn.Module):
    """Predicts each member's mean target-training label: x (E, N, 2) -> (E, N)."""

    def __init__(self, y_train: torch.Tensor):
        super().__init__()
        self.register_buffer("mean", y_train.mean(dim=1))  # (E,)

    def forward(self, x: torch.Tensor, instruction: torch.Tensor | None = None, ctx=None, task=None) -> torch.Tensor:
        return self.mean.unsqueeze(1).expand(x.shape[0], x.shape[1])


class Mean(Method):
    name = "mean"
    summary = "predict the mean of the target training labels (what a collapsed model scores)"
    kind = "reference"
    trains = False

    def build(self, backbone, config, generators, y_train):
        return MeanPredictor(y_train)


FROZEN = Frozen()
MEAN = Mean()
