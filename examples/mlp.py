"""A small MLP classifier with GELU and LayerNorm, trained with SGD + momentum.

As a glmc FILE: defines `model`, `example_inputs` (x, y), `loss_fn` and `optimizer`.
    glmc compile examples/mlp.py --backend eager --steps 5
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.norm(self.fc1(x))))


def make_batch(batch: int = 16, d_in: int = 32, classes: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, d_in, generator=g), torch.randint(0, classes, (batch,), generator=g)


torch.manual_seed(0)
model = MLP()
example_inputs = make_batch()
loss_fn = F.cross_entropy
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
