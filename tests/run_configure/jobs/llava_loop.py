"""A tiny LLaVA (``LlavaForConditionalGeneration`` from tiny configs, no download) trained by
a plain loop that knows nothing of trainvitals and tags nothing. Per step 4 micro-batches
of one sample, image and text alternating: an image sample is its 4 image tokens, a
prompt and a 1-token answer; a text sample 30 trained tokens. The loss is normalized
over the step's label tokens (per token).

The truth, printed per step (``step N image_share S``): the image samples' share of the
step's gradient weight, by autograd on the per-token losses, an image sample being one
with pixel values.
"""

import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.simplefilter("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the tiny models (torch and transformers only)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.integrations._hf_models import IMAGE, PATCHES, VOCAB, tiny_llava  # noqa: E402

torch.set_num_threads(1)
model = tiny_llava()  # seeded
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(0)


def sample(image):
    if image:
        ids = torch.cat([torch.tensor([1]), torch.full((PATCHES,), IMAGE), torch.randint(3, IMAGE, (7,), generator=g)])
        labels = torch.full_like(ids, -100)
        labels[-2:] = ids[-2:]
        return ids[None], labels[None], torch.randn(1, 3, 8, 8, generator=g)
    ids = torch.randint(3, IMAGE, (30,), generator=g)
    return ids[None], ids.clone()[None], None


for step in range(1, 5):
    batches = [sample(k % 2 == 0) for k in range(4)]
    total = sum(int((lab[:, 1:] != -100).sum()) for _, lab, _ in batches)
    image_w = all_w = 0.0
    for ids, labels, pixels in batches:
        logits = model(input_ids=ids, pixel_values=pixels).logits
        per_token = F.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), reduction="none", ignore_index=-100
        )
        loss = per_token.sum() / total
        (w,) = torch.autograd.grad(loss, per_token, retain_graph=True)
        w = w[labels[:, 1:].reshape(-1) != -100]  # label tokens only
        all_w += float(w.sum())
        image_w += float(w.sum()) if pixels is not None else 0.0
        loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} image_share {image_w / all_w!r}", flush=True)
