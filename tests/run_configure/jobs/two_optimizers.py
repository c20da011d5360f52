"""A GAN-shaped script: two models, two optimizers, stepped in turn (run by the tests
under ``trainvitals run``)."""

import torch
from torch import nn


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, z):
        return self.net(z) * self.scale


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.features(x))))


torch.manual_seed(0)
torch.set_num_threads(1)
gen, disc = Generator(), Discriminator()
opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
bce = nn.BCEWithLogitsLoss()
for _step in range(4):
    real, fake = torch.randn(16, 8), gen(torch.randn(16, 4))
    d_loss = bce(disc(real), torch.ones(16, 1)) + bce(disc(fake.detach()), torch.zeros(16, 1))
    opt_d.zero_grad()
    d_loss.backward()
    opt_d.step()
    g_loss = bce(disc(fake), torch.ones(16, 1))
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()
print("trained", flush=True)
