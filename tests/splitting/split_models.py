"""Models that are not an nn.Sequential, for gpipe.split: keyword arguments, a dict output,
a tied weight, sizes used inside blocks, and residual blocks inside stages."""

import torch
from torch import nn

VOCAB, WIDTH, LENGTH = 13, 8, 6


class Block(nn.Module):
    """A residual block that reshapes with the batch size it is given (a size that crosses
    stages) and masks padded positions."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, mask, rows: int):
        h = torch.tanh(self.mix(self.norm(x))).reshape(rows, -1, WIDTH)
        return x + h * mask.unsqueeze(-1)


class TinyLM(nn.Module):
    """Embedding, blocks in a ModuleList, and a head tied to the embedding; takes
    ``input_ids``, ``attention_mask`` and optional ``labels`` and returns a dict (with the
    loss, averaged over unmasked tokens, when given labels), or a tensor."""

    def __init__(self, n_blocks: int = 4, return_dict: bool = True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.randn(32, WIDTH) * 0.1)
        self.blocks = nn.ModuleList([Block() for _ in range(n_blocks)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head.weight = self.embed.weight
        self.return_dict = return_dict

    def forward(self, input_ids, attention_mask=None, labels=None):
        rows, length = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = attention_mask.to(self.embed.weight.dtype)
        x = self.embed(input_ids) + self.position[:length]
        for block in self.blocks:
            x = block(x, mask, rows)
        logits = self.head(self.norm(x))
        if not self.return_dict:
            return logits
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), ignore_index=-100
            )
        return out


def tiny_lm(seed: int = 0, dtype=torch.float64, **kwargs) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs).to(dtype)


def token_batch(rows: int = 6, length: int = LENGTH, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    labels = ids.roll(-1, 1)
    for r in range(rows):  # padding that differs from row to row
        pad = r % 3
        if pad:
            mask[r, -pad:] = 0
            labels[r, -pad:] = -100
    labels[:, -1] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class Residual(nn.Module):
    """A ResNet basic block without normalization: two convolutions and a shortcut, with a
    projection where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.shortcut = (
            nn.Conv2d(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()
        )

    def forward(self, x):
        return torch.relu(self.conv2(torch.relu(self.conv1(x))) + self.shortcut(x))


class TinyResNet(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, 1, 1)
        self.layer1 = nn.Sequential(Residual(4, 4), Residual(4, 4))
        self.layer2 = nn.Sequential(Residual(4, 8, 2), Residual(8, 8))
        self.fc = nn.Linear(8, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(torch.relu(self.stem(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def tiny_resnet(seed: int = 0, dtype=torch.float64) -> TinyResNet:
    torch.manual_seed(seed)
    return TinyResNet().to(dtype)


def images(rows: int = 6, seed: int = 2, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, 8, 8, generator=g, dtype=dtype), torch.randint(
        0, 5, (rows,), generator=g
    )
