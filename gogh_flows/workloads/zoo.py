"""The seven model families Gavel measured, in plain torch.

Why these: they are the job types whose throughputs Gavel (Narayanan et al.,
OSDI 2020) measured on K80, P100 and V100 GPUs, alone and co-located.  Building
the same models here means the features we extract for a job type line up with
a measured throughput, which is what GOGH's predictors are trained on.  The
family names are spelled exactly as in Gavel's data ("ResNet-50 (batch size
64)") because they key its throughput tables.

The architectures follow the public reference models, written from their
papers' descriptions (no torchvision or other model packages):

* ResNet-18 -- CIFAR-10 variant of He et al. 2016 (3x3 stem, no max-pool).
* ResNet-50 -- ImageNet ResNet-50 v1.5 (bottlenecks [3, 4, 6, 3], stride on the 3x3).
* Transformer -- Vaswani et al. 2017 encoder-decoder, base width, on Multi30k-sized vocabularies.
* LM -- 2-layer LSTM language model of PyTorch's word_language_model on WikiText-2
  (Zaremba et al.'s "medium" width 650, bptt 35).
* Recommendation -- NeuMF (He et al. 2017, NCF) on MovieLens-20M.
* A3C -- Mnih et al. 2015/2016 Atari network with policy and value heads.
* CycleGAN -- Zhu et al. 2017: ResNet generators (9 blocks) and 70x70 PatchGAN
  discriminators; one training step runs both of each (:class:`CycleGANStep`).

Everything is built under a ``torch.device`` context, so ``device="meta"``
allocates nothing even for the large embedding tables.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
from torch import nn

from gogh_flows.workloads.feature_cache import cached_features
from gogh_flows.workloads.features import (
    WorkloadFeatures,
    check_batch_size,
    check_kind,
    extract_features,
)

FAMILIES: tuple[str, ...] = (
    "ResNet-18", "ResNet-50", "Transformer", "LM", "Recommendation", "A3C", "CycleGAN",
)

#: Batch sizes in Gavel's throughput measurements.
DEFAULT_BATCH_SIZES: dict[str, tuple[int, ...]] = {
    "ResNet-18": (16, 32, 64, 128, 256),
    "ResNet-50": (16, 32, 64, 128),
    "Transformer": (16, 32, 64, 128, 256),
    "LM": (5, 10, 20, 40, 80),
    "Recommendation": (512, 1024, 2048, 4096, 8192),
    "A3C": (20,),
    "CycleGAN": (1,),
}

# Dataset-shaped constants of the reference workloads.
CIFAR_CLASSES = 10
IMAGENET_CLASSES = 1000
TRANSFORMER_VOCAB = 10_000  # Multi30k de-en vocabularies are ~10k tokens
TRANSFORMER_SEQ_LEN = 30
WIKITEXT2_VOCAB = 33_278
LM_WIDTH = 650
LM_BPTT = 35
ML20M_USERS = 138_493
ML20M_ITEMS = 26_744
ATARI_FRAMES = 4  # stacked grey frames
ATARI_ACTIONS = 6  # Pong
CYCLEGAN_SIZE = 256

_JOB_TYPE = re.compile(r"^\s*(?P<family>.+?)\s*\(batch size (?P<bs>[-+]?\d+)\)\s*$")


@dataclass(frozen=True)
class ZooModel:
    """A built zoo model with an example input at its batch size."""

    family: str
    batch_size: int
    module: nn.Module
    example_inputs: tuple  # positional args: module(*example_inputs); dim 0 is the batch
    job_type: str  # Gavel's job-type string, e.g. "ResNet-50 (batch size 64)"


# --------------------------------------------------------------------------- ResNets


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or 1x1 projection) shortcut."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = _projection(in_planes, planes, stride)
        self.relu2 = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        return self.relu2(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, as in v1.5), 1x1 expand by 4."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_planes = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        self.shortcut = _projection(in_planes, out_planes, stride)
        self.relu3 = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu3(out + self.shortcut(x))


def _projection(in_planes: int, out_planes: int, stride: int) -> nn.Module:
    if stride == 1 and in_planes == out_planes:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(in_planes, out_planes, 1, stride, bias=False), nn.BatchNorm2d(out_planes)
    )


class ResNet(nn.Module):
    """A ResNet body: a stem, four stages of residual blocks, pooling and a classifier."""

    def __init__(
        self, block: type[BasicBlock] | type[Bottleneck], depths: tuple[int, ...],
        stem: nn.Module, num_classes: int,
    ) -> None:
        super().__init__()
        self.stem = stem
        in_planes = 64
        stages = []
        for i, depth in enumerate(depths):
            planes, stride = 64 * 2**i, 1 if i == 0 else 2
            blocks = []
            for j in range(depth):
                blocks.append(block(in_planes, planes, stride if j == 0 else 1))
                in_planes = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))
        return self.fc(self.flatten(self.pool(x)))


def resnet18_cifar() -> ResNet:
    stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True))
    return ResNet(BasicBlock, (2, 2, 2, 2), stem, CIFAR_CLASSES)


def resnet50_imagenet() -> ResNet:
    stem = nn.Sequential(
        nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    )
    return ResNet(Bottleneck, (3, 4, 6, 3), stem, IMAGENET_CLASSES)


# --------------------------------------------------------------------------- Transformer


class PositionalEncoding(nn.Module):
    """Fixed sinusoidal positions added to scaled token embeddings."""

    def __init__(self, d_model: int, max_len: int = 512) -> None:
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
        freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10_000.0) / d_model))
        table = torch.zeros(max_len, d_model)
        table[:, 0::2] = torch.sin(pos * freq)
        table[:, 1::2] = torch.cos(pos * freq)
        self.register_buffer("table", table, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table[: x.shape[1]]


class Seq2SeqTransformer(nn.Module):
    """Token embeddings, ``nn.Transformer`` (batch-first) and a vocabulary projection."""

    def __init__(
        self, src_vocab: int = TRANSFORMER_VOCAB, tgt_vocab: int = TRANSFORMER_VOCAB,
        d_model: int = 512, nhead: int = 8, layers: int = 6, ffn: int = 2048, dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.scale = math.sqrt(d_model)
        self.src_embed = nn.Embedding(src_vocab, d_model)
        self.tgt_embed = nn.Embedding(tgt_vocab, d_model)
        self.positions = PositionalEncoding(d_model)
        self.dropout = nn.Dropout(dropout)
        self.transformer = nn.Transformer(
            d_model, nhead, layers, layers, ffn, dropout, batch_first=True
        )
        self.generator = nn.Linear(d_model, tgt_vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        src_x = self.dropout(self.positions(self.src_embed(src) * self.scale))
        tgt_x = self.dropout(self.positions(self.tgt_embed(tgt) * self.scale))
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        return self.generator(self.transformer(src_x, tgt_x, tgt_mask=causal, tgt_is_causal=True))


# --------------------------------------------------------------------------- LM


class LSTMLanguageModel(nn.Module):
    """Embedding, 2-layer LSTM with dropout, and a decoder to the vocabulary."""

    def __init__(self, vocab: int = WIKITEXT2_VOCAB, width: int = LM_WIDTH, layers: int = 2,
                 dropout: float = 0.5) -> None:
        super().__init__()
        self.encoder = nn.Embedding(vocab, width)
        self.drop_in = nn.Dropout(dropout)
        self.rnn = nn.LSTM(width, width, layers, dropout=dropout, batch_first=True)
        self.drop_out = nn.Dropout(dropout)
        self.decoder = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.drop_in(self.encoder(tokens)))
        return self.decoder(self.drop_out(out))


# --------------------------------------------------------------------------- Recommendation


class NeuMF(nn.Module):
    """NCF's NeuMF: a GMF branch (elementwise product) and an MLP tower, fused by a linear."""

    def __init__(self, users: int = ML20M_USERS, items: int = ML20M_ITEMS, mf_dim: int = 64,
                 mlp: tuple[int, ...] = (256, 128, 64)) -> None:
        super().__init__()
        self.mf_user = nn.Embedding(users, mf_dim)
        self.mf_item = nn.Embedding(items, mf_dim)
        self.mlp_user = nn.Embedding(users, mlp[0] // 2)
        self.mlp_item = nn.Embedding(items, mlp[0] // 2)
        tower: list[nn.Module] = []
        for width_in, width_out in zip(mlp, mlp[1:]):
            tower += [nn.Linear(width_in, width_out), nn.ReLU(inplace=True)]
        self.mlp = nn.Sequential(*tower)
        self.predict = nn.Linear(mf_dim + mlp[-1], 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        gmf = self.mf_user(users) * self.mf_item(items)
        deep = self.mlp(torch.cat([self.mlp_user(users), self.mlp_item(items)], dim=-1))
        return self.predict(torch.cat([gmf, deep], dim=-1)).squeeze(-1)


# --------------------------------------------------------------------------- A3C


class AtariActorCritic(nn.Module):
    """Nature-DQN convolutions, a 512-unit layer, a policy head and a value head."""

    def __init__(self, frames: int = ATARI_FRAMES, actions: int = ATARI_ACTIONS) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(frames, 32, 8, 4), nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 4, 2), nn.ReLU(inplace=True),
            nn.Conv2d(64, 64, 3, 1), nn.ReLU(inplace=True),
            nn.Flatten(), nn.Linear(64 * 7 * 7, 512), nn.ReLU(inplace=True),
        )
        self.policy = nn.Linear(512, actions)
        self.value = nn.Linear(512, 1)

    def forward(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.features(frames)
        return self.policy(hidden), self.value(hidden)


# --------------------------------------------------------------------------- CycleGAN


class ResnetBlock(nn.Module):
    """Reflection-padded 3x3 conv, instance norm, ReLU, again, plus the input."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.ReflectionPad2d(1), nn.Conv2d(dim, dim, 3), nn.InstanceNorm2d(dim), nn.ReLU(inplace=True),
            nn.ReflectionPad2d(1), nn.Conv2d(dim, dim, 3), nn.InstanceNorm2d(dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def resnet_generator(ngf: int = 64, blocks: int = 9) -> nn.Sequential:
    """c7s1-64, d128, d256, 9 x R256, u128, u64, c7s1-3 (Johnson et al. layout)."""
    layers: list[nn.Module] = [
        nn.ReflectionPad2d(3), nn.Conv2d(3, ngf, 7), nn.InstanceNorm2d(ngf), nn.ReLU(inplace=True),
    ]
    for mult in (1, 2):
        layers += [nn.Conv2d(ngf * mult, ngf * mult * 2, 3, 2, 1), nn.InstanceNorm2d(ngf * mult * 2),
                   nn.ReLU(inplace=True)]
    layers += [ResnetBlock(ngf * 4) for _ in range(blocks)]
    for mult in (4, 2):
        layers += [nn.ConvTranspose2d(ngf * mult, ngf * mult // 2, 3, 2, 1, output_padding=1),
                   nn.InstanceNorm2d(ngf * mult // 2), nn.ReLU(inplace=True)]
    layers += [nn.ReflectionPad2d(3), nn.Conv2d(ngf, 3, 7), nn.Tanh()]
    return nn.Sequential(*layers)


def patch_discriminator(ndf: int = 64, n_layers: int = 3) -> nn.Sequential:
    """70x70 PatchGAN: 4x4 convs (stride 2 then 1), instance norm, LeakyReLU 0.2."""
    layers: list[nn.Module] = [nn.Conv2d(3, ndf, 4, 2, 1), nn.LeakyReLU(0.2, inplace=True)]
    width = ndf
    for n in range(1, n_layers + 1):
        out = ndf * min(2**n, 8)
        stride = 2 if n < n_layers else 1
        layers += [
            nn.Conv2d(width, out, 4, stride, 1), nn.InstanceNorm2d(out), nn.LeakyReLU(0.2, inplace=True),
        ]
        width = out
    layers.append(nn.Conv2d(width, 1, 4, 1, 1))
    return nn.Sequential(*layers)


class CycleGANStep(nn.Module):
    """Everything one CycleGAN training step computes, as one forward.

    Generator update: both translations, both cycles, both identity mappings
    (the reference's default ``lambda_identity=0.5``) and the discriminators on
    the fakes; discriminator update: each discriminator on a real and a fake.
    Returns every produced tensor so nothing is dead code.
    """

    def __init__(self, ngf: int = 64, ndf: int = 64) -> None:
        super().__init__()
        self.G_AB = resnet_generator(ngf)
        self.G_BA = resnet_generator(ngf)
        self.D_A = patch_discriminator(ndf)  # judges domain B images (fakes from G_AB)
        self.D_B = patch_discriminator(ndf)  # judges domain A images (fakes from G_BA)

    def forward(self, real_A: torch.Tensor, real_B: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fake_B, fake_A = self.G_AB(real_A), self.G_BA(real_B)
        rec_A, rec_B = self.G_BA(fake_B), self.G_AB(fake_A)
        idt_B, idt_A = self.G_AB(real_B), self.G_BA(real_A)
        g_adv = (self.D_A(fake_B), self.D_B(fake_A))
        d_real = (self.D_A(real_B), self.D_B(real_A))
        d_fake = (self.D_A(fake_B.detach()), self.D_B(fake_A.detach()))
        return (fake_A, fake_B, rec_A, rec_B, idt_A, idt_B, *g_adv, *d_real, *d_fake)


# --------------------------------------------------------------------------- builders


def _image_input(bs: int, channels: int, size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    return (torch.randn(bs, channels, size, size, device=device),)


def _tokens(bs: int, length: int, vocab: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, vocab, (bs, length), device=device)


_BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "ResNet-18": resnet18_cifar,
    "ResNet-50": resnet50_imagenet,
    "Transformer": Seq2SeqTransformer,
    "LM": LSTMLanguageModel,
    "Recommendation": NeuMF,
    "A3C": AtariActorCritic,
    "CycleGAN": CycleGANStep,
}

_INPUTS: dict[str, Callable[[int, torch.device], tuple[torch.Tensor, ...]]] = {
    "ResNet-18": lambda bs, d: _image_input(bs, 3, 32, d),
    "ResNet-50": lambda bs, d: _image_input(bs, 3, 224, d),
    "Transformer": lambda bs, d: (
        _tokens(bs, TRANSFORMER_SEQ_LEN, TRANSFORMER_VOCAB, d),
        _tokens(bs, TRANSFORMER_SEQ_LEN, TRANSFORMER_VOCAB, d),
    ),
    "LM": lambda bs, d: (_tokens(bs, LM_BPTT, WIKITEXT2_VOCAB, d),),
    "Recommendation": lambda bs, d: (
        torch.randint(0, ML20M_USERS, (bs,), device=d), torch.randint(0, ML20M_ITEMS, (bs,), device=d),
    ),
    "A3C": lambda bs, d: _image_input(bs, ATARI_FRAMES, 84, d),
    "CycleGAN": lambda bs, d: _image_input(bs, 3, CYCLEGAN_SIZE, d) + _image_input(bs, 3, CYCLEGAN_SIZE, d),
}


def families_like(name: str) -> list[str]:
    """Zoo families a mistyped name probably meant ("ResNet50", "resnet", "transfomer")."""
    typed = name.strip().lower() if isinstance(name, str) else ""
    if not typed:
        return []
    close = difflib.get_close_matches(typed, [f.lower() for f in FAMILIES], n=3, cutoff=0.5)
    close += [f.lower() for f in FAMILIES if f.lower().startswith(typed)]
    return [f for f in FAMILIES if f.lower() in close]


def canonical_family(family: str) -> str:
    """The family as Gavel spells it; matching ignores case and surrounding spaces."""
    if isinstance(family, str):
        wanted = family.strip().lower()
        for name in FAMILIES:
            if name.lower() == wanted:
                return name
    meant = families_like(family)
    raise ValueError(
        f"unknown model family {family!r}"
        + (f" (did you mean {' or '.join(map(repr, meant))}?)" if meant else "")
        + f"; known families are {', '.join(FAMILIES)} (matched case-insensitively, e.g. 'resnet-50')"
    )


def _resolve(family: str, batch_size: int | None) -> tuple[str, int]:
    name = canonical_family(family)
    if batch_size is None:
        return name, DEFAULT_BATCH_SIZES[name][0]
    return name, check_batch_size(batch_size)


def build_model(
    family: str, batch_size: int | None = None, *, device: str | torch.device = "meta"
) -> ZooModel:
    """Build a zoo family with a random example input of ``batch_size`` rows.

    ``batch_size=None`` takes the smallest size Gavel measured.  On ``meta``
    nothing is allocated; on ``cpu`` the model runs for real.
    """
    name, bs = _resolve(family, batch_size)
    dev = torch.device(device)
    with dev:
        module = _BUILDERS[name]()
    inputs = _INPUTS[name](bs, dev)
    return ZooModel(family=name, batch_size=bs, module=module, example_inputs=inputs,
                    job_type=job_type_name(name, bs))


def zoo_features(family: str, batch_size: int | None = None, kind: str = "training") -> WorkloadFeatures:
    """Features of a zoo family at ``batch_size``, computed once per (family, size, kind)."""
    name, bs = _resolve(family, batch_size)
    check_kind(kind)
    return _zoo_features_cached(name, bs, kind)


#: Every zoo family is affine in the batch dimension (per-sample work plus
#: batch-independent pieces such as a causal mask), so two forward passes per
#: family give the exact features at every batch size.
REFERENCE_BATCH_SIZES = (4, 8)


@lru_cache(maxsize=None)
def _zoo_features_cached(family: str, batch_size: int, kind: str) -> WorkloadFeatures:
    lo, hi = (_zoo_reference(family, b, kind) for b in REFERENCE_BATCH_SIZES)
    if batch_size in REFERENCE_BATCH_SIZES:
        return lo if batch_size == lo.batch_size else hi
    return _interpolate(lo, hi, batch_size)


@lru_cache(maxsize=None)
def _zoo_reference(family: str, batch_size: int, kind: str) -> WorkloadFeatures:
    def extract() -> WorkloadFeatures:
        built = build_model(family, batch_size, device="meta")
        return extract_features(built.module, built.example_inputs, kind=kind, batch_size=batch_size)

    return cached_features(f"{family}-{batch_size}-{kind}", extract, batch_size=batch_size, kind=kind)


def _interpolate(lo: WorkloadFeatures, hi: WorkloadFeatures, batch_size: int) -> WorkloadFeatures:
    t = (batch_size - lo.batch_size) / (hi.batch_size - lo.batch_size)

    def at(a: float, b: float) -> float:
        return a + (b - a) * t

    layers = tuple(
        replace(a, flops=at(a.flops, b.flops),
                activation_bytes=round(at(a.activation_bytes, b.activation_bytes)),
                input_bytes=round(at(a.input_bytes, b.input_bytes)))
        for a, b in zip(lo.layers, hi.layers, strict=True)
    )
    return WorkloadFeatures(layers, batch_size, lo.kind)


INFERENCE_SUFFIX = " [inference]"


def job_type_name(family: str, batch_size: int, kind: str = "training") -> str:
    """Gavel's job-type string: "ResNet-50 (batch size 64)".

    A3C and CycleGAN were measured at one batch size and Gavel names them
    without it; other sizes of those get the suffix so names stay unique.
    Inference runs are named apart ("ResNet-50 (batch size 64) [inference]"): they run
    a third of a training step's work, so their measurements must not be averaged with
    training runs of the same model.
    """
    name, bs = canonical_family(family), check_batch_size(batch_size)
    check_kind(kind)
    base = name if DEFAULT_BATCH_SIZES[name] == (bs,) else f"{name} (batch size {bs})"
    return base + (INFERENCE_SUFFIX if kind == "inference" else "")


def parse_job_kind(job_type: str) -> tuple[str, int, str]:
    """Inverse of :func:`job_type_name`: ("ResNet-50", 64, "training")."""
    if not isinstance(job_type, str):
        raise ValueError(f"job type must be a string like 'ResNet-50 (batch size 64)', got {job_type!r}")
    kind = "training"
    text = job_type.rstrip()
    if text.endswith(INFERENCE_SUFFIX.strip()):
        kind, text = "inference", text[: -len(INFERENCE_SUFFIX.strip())]
    match = _JOB_TYPE.match(text)
    if match:
        return canonical_family(match["family"]), check_batch_size(int(match["bs"])), kind
    if "(" in text and "batch" in text.lower():  # meant as a job-type name, mistyped: say its form
        family = text.split("(", 1)[0].strip() or "ResNet-50"
        raise ValueError(f"cannot read the job type {job_type!r}: write it as 'FAMILY (batch size N)', "
                         f"e.g. '{family} (batch size 20)'")
    return (*_resolve(text.strip(), None), kind)


def parse_job_type(job_type: str) -> tuple[str, int]:
    """(family, batch size) of a job-type name; a bare family gets its default size."""
    family, bs, _ = parse_job_kind(job_type)
    return family, bs


def family_of(job_type: str) -> str:
    """The family of a job-type string."""
    return parse_job_type(job_type)[0]


__all__ = [
    "FAMILIES", "DEFAULT_BATCH_SIZES", "ZooModel", "build_model", "zoo_features", "job_type_name",
    "parse_job_type", "parse_job_kind", "family_of", "canonical_family", "CycleGANStep",
]
