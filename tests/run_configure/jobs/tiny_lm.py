"""A tiny language model trained with a plain cross-entropy loss and two micro-batches
per step (run by the tests under ``trainvitals run``: its logits come from a linear
layer sized like the embedding's vocabulary, so zero-code loss accounting finds them)."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 48


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.mix(self.embed(ids))))


torch.manual_seed(0)
torch.set_num_threads(1)
model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for _step in range(3):
    opt.zero_grad()
    for _ in range(2):  # micro-batches, each loss divided by their count
        ids = torch.randint(0, VOCAB, (4, 10))
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()) / 2
        loss.backward()
    opt.step()
print("trained", flush=True)
