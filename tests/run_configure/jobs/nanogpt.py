"""A nanoGPT-style character model and training loop, knowing nothing of trainvitals.

As nanoGPT's shakespeare_char config: a 65-token vocabulary and a 256-position table
(the position embedding is larger than the token embedding), the head tied to the
token embedding, the loss computed inside ``forward`` and gradient accumulation over
micro-steps. ``--undivided`` drops the ``loss / gradient_accumulation_steps`` (the
bug); ``--width 64`` makes the MLP 64 -> 256, sized like the position table.

The true per-token loss weights (``dL/dl_t``, by autograd on the per-token losses the
model keeps) are printed per step: ``step N mass M wmax A wmin B``.
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--undivided", action="store_true")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--width", type=int, default=32)
args = parser.parse_args()

VOCAB, BLOCK, WIDTH, HEADS = 65, 256, args.width, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.c_fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.mlp_proj = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, WIDTH),
                "wpe": nn.Embedding(BLOCK, WIDTH),
                "h": nn.ModuleList([Block(), Block()]),
                "ln_f": nn.LayerNorm(WIDTH),
            }
        )
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.per_token = None

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        pos = torch.arange(t, dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            flat = targets.reshape(-1)
            self.per_token = F.cross_entropy(logits.view(-1, VOCAB), flat, reduction="none", ignore_index=-1)
            loss = self.per_token[flat != -1].mean()  # = F.cross_entropy(..., ignore_index=-1)
        return logits, loss


torch.manual_seed(0)
torch.set_num_threads(1)
model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
gradient_accumulation_steps = 4
gen = torch.Generator().manual_seed(1)


def get_batch(k):
    length = 24 + 8 * k  # micro-batches of different lengths
    data = torch.randint(0, VOCAB, (3, length + 1), generator=gen)
    x, y = data[:, :-1], data[:, 1:].clone()
    y[0, : length // 3] = -1  # a prompt that is not trained on
    return x, y


for step in range(1, args.steps + 1):
    mass, wmax, wmin = 0.0, -math.inf, math.inf
    for micro_step in range(gradient_accumulation_steps):
        X, Y = get_batch(micro_step)
        logits, loss = model(X, Y)
        if not args.undivided:
            loss = loss / gradient_accumulation_steps
        (w,) = torch.autograd.grad(loss, model.per_token, retain_graph=True)
        w = w[Y.reshape(-1) != -1]
        mass += float(w.sum())
        wmax, wmin = max(wmax, float(w.max())), min(wmin, float(w.min()))
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step} mass {mass!r} wmax {wmax!r} wmin {wmin!r}", flush=True)
print("trained", flush=True)
