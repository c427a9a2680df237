"""A small CNN: convolutions, BatchNorm (running-stat buffers), dropout, Adam.

As a glmc FILE: defines `workload()` returning (model, example_inputs, loss_fn, optimizer).
    glmc compile examples/cnn.py --steps 5
Convolutions before BatchNorm have no bias (BatchNorm cancels it, and its gradient is only
rounding noise that Adam would amplify).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class CNN(nn.Module):
    def __init__(self, channels: int = 16, classes: int = 10, dropout: float = 0.25) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(2 * channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.dropout(x.mean(dim=(2, 3)))
        return self.fc(x)


def make_batch(batch: int = 8, size: int = 16, classes: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, size, size, generator=g),
            torch.randint(0, classes, (batch,), generator=g))


def workload(channels: int = 16, batch: int = 8, size: int = 16):
    torch.manual_seed(0)
    model = CNN(channels)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, make_batch(batch, size), F.cross_entropy, optimizer
