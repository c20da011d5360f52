"""The README's minimal example: a tiny two-modality model, streamed to a collector.

trainvitals serve &                                  # in one shell
TRAINVITALS_COLLECTOR=http://127.0.0.1:9477 python examples/minimal.py
curl -s localhost:9477/metrics | grep trainvitals_grad_norm
"""

import torch
import torch.nn.functional as F
from torch import nn

from trainvitals.hooks import attach

torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(100, 32), nn.RMSNorm(32), nn.Linear(32, 100))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
# The collector comes from $TRAINVITALS_COLLECTOR (else a local JSONL file).
mon = attach(model, opt, run="minimal", modalities=("text", "image"), every=5)

for _ in range(20):
    ids = torch.randint(0, 100, (8, 16))
    labels = ids.roll(-1, dims=1)
    modality = torch.tensor([0] * 6 + [1] * 2)  # 6 text samples, 2 image samples
    logits = model(ids)
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    mon.track_loss(per_token, modality=modality, output=logits)
    loss = per_token.mean()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf"))
    opt.step()
    opt.zero_grad()

print(f"step {mon.step} grad_norm {norm.item():.9g}")
mon.close()
