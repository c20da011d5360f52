"""A language model whose head zero-code cannot find: the logits come from a raw
parameter stored transposed ([width, vocab], no module tied to or sized like the token
embedding). Under ``trainvitals run`` loss accounting cannot engage; the job must hear
why, and the collector must warn."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH = 13, 8


class HiddenHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.unembed = nn.Parameter(torch.randn(WIDTH, VOCAB) * 0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.embed(ids)) @ self.unembed


torch.manual_seed(0)
model = HiddenHead()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(int(sys.argv[1])):
    ids = torch.randint(0, VOCAB, (2, 6))
    F.cross_entropy(model(ids).reshape(-1, VOCAB), ids.roll(-1, 1).reshape(-1)).backward()
    opt.step()
    opt.zero_grad()
