"""VGG-16 and ResNet-50 (torchvision) and their narrow CPU variants, as one vision workload.

width_div == 1 gives torchvision's own models (`vgg16(weights=None)`, `resnet50(weights=None)`).
width_div > 1 keeps the depth and layer structure and divides every width by width_div:
- VGG-16: the 13 convs of config "D" scaled; classifier Linear-ReLU-Dropout-Linear-ReLU-Dropout-Linear
  with hidden width 4096 / width_div. The adaptive pool before it outputs p x p with
  p = clamp(image_size // 32, 1, 7): at 32 px the features are already 1x1, and torchvision's 7x7
  pool would only copy them 49 times into a 49x larger first Linear.
- ResNet-50: Bottleneck [3, 4, 6, 3] with the stem width (64) and every stage's planes
  (64/128/256/512, so outputs 256..2048) divided; torchvision's ResNet cannot scale the stem, so
  `NarrowResNet` sets up the same attributes itself and reuses torchvision's `_make_layer`,
  `Bottleneck` and `forward`.
Every ReLU is made non-inplace (torchgpipe breaks on in-place ReLU at partition starts).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn
from torchvision.models import resnet as tv_resnet
from torchvision.models import vgg as tv_vgg

from ptbench.core.config import DataConfig, WorkloadConfig
from ptbench.core.errors import ConfigError
from ptbench.workloads import data as D
from ptbench.workloads.base import Workload


class NarrowVGG(tv_vgg.VGG):
    """VGG with a given feature stack, pool size and classifier width; torchvision's forward and init."""

    def __init__(self, features: nn.Sequential, num_classes: int, pool: int, hidden: int, dropout: float = 0.5):
        nn.Module.__init__(self)
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((pool, pool))
        channels = [m.out_channels for m in features if isinstance(m, nn.Conv2d)][-1]
        self.classifier = nn.Sequential(
            nn.Linear(channels * pool * pool, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )
        for m in self.modules():  # as torchvision's VGG(init_weights=True)
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)


class NarrowResNet(tv_resnet.ResNet):
    """ResNet-50 with stem and stage widths divided by `width_div`; torchvision's blocks, forward, init."""

    def __init__(self, width_div: int, num_classes: int, layers=(3, 4, 6, 3)):
        nn.Module.__init__(self)
        self._norm_layer = nn.BatchNorm2d
        self.inplanes, self.dilation, self.groups, self.base_width = 64 // width_div, 1, 1, 64
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        B = tv_resnet.Bottleneck
        self.layer1 = self._make_layer(B, 64 // width_div, layers[0])
        self.layer2 = self._make_layer(B, 128 // width_div, layers[1], stride=2)
        self.layer3 = self._make_layer(B, 256 // width_div, layers[2], stride=2)
        self.layer4 = self._make_layer(B, 512 // width_div, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 // width_div * B.expansion, num_classes)
        for m in self.modules():  # as torchvision's ResNet
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)


def _no_inplace(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = False
    return model


def _channels_last_input(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook on the first convolution: its input in channels_last (NHWC) memory format."""
    return (args[0].contiguous(memory_format=torch.channels_last), *args[1:])


def use_channels_last(setting: bool | None, device_type: str) -> bool:
    """workload.channels_last: None (auto) = on for CUDA only, where tensor-core convolutions run in NHWC
    and cuDNN picks that layout from the weights; on CPU NCHW stays the default. A pure function of the
    device type (the CPU twin tests call it with "cuda")."""
    return device_type == "cuda" if setting is None else bool(setting)


def use_cudnn_benchmark(setting: bool | None, device_type: str) -> bool:
    """workload.cudnn_benchmark: None (auto) = on for CUDA, where cuDNN then times its convolution algorithms
    for each new input shape once and keeps the fastest (a benchmark's shapes are fixed: the first, untimed
    steps pay for it); no effect on CPU, so off there."""
    return device_type == "cuda" if setting is None else bool(setting)


def build_vision_model(
    arch: str, num_classes: int, image_size: int = 224, width_div: int = 1, dropout: float = 0.5
) -> nn.Module:
    if width_div < 1 or 64 % width_div:
        raise ConfigError(f"workload.width_div={width_div} must divide 64 (1, 2, 4, 8, 16, 32 or 64)")
    if arch == "vgg16":
        if width_div == 1:
            model = tv_vgg.vgg16(weights=None, num_classes=num_classes, dropout=dropout)
        else:
            cfg = [v if v == "M" else v // width_div for v in tv_vgg.cfgs["D"]]
            pool = max(1, min(7, image_size // 32))
            model = NarrowVGG(tv_vgg.make_layers(cfg), num_classes, pool, 4096 // width_div, dropout)
    elif arch == "resnet50":
        if width_div == 1:
            model = tv_resnet.resnet50(weights=None, num_classes=num_classes)
        else:
            model = NarrowResNet(width_div, num_classes)
    else:
        raise ConfigError(f"workload.arch '{arch}' is not a vision model: use vgg16 or resnet50")
    return _no_inplace(model)


def vision_sequential(model: nn.Module) -> nn.Sequential:
    """VGG: features' 31 layers, avgpool, flatten, classifier's 7 = 40 layers. ResNet-50: conv1, bn1,
    relu, maxpool, 16 bottleneck blocks, avgpool, flatten, fc = 23 layers. Shares `model`'s modules."""
    if isinstance(model, tv_vgg.VGG):
        layers = [(f"features_{i}", m) for i, m in enumerate(model.features)]
        layers += [("avgpool", model.avgpool), ("flatten", nn.Flatten(1))]
        layers += [(f"classifier_{i}", m) for i, m in enumerate(model.classifier)]
    elif isinstance(model, tv_resnet.ResNet):
        layers = [(n, getattr(model, n)) for n in ("conv1", "bn1", "relu", "maxpool")]
        for s in ("layer1", "layer2", "layer3", "layer4"):
            layers += [(f"{s}_{i}", b) for i, b in enumerate(getattr(model, s))]
        layers += [("avgpool", model.avgpool), ("flatten", nn.Flatten(1)), ("fc", model.fc)]
    else:
        raise TypeError(f"no sequential form for {type(model).__name__}")
    return nn.Sequential(OrderedDict(layers))


def layer_flops(model: nn.Module, image_size: int) -> list[int]:
    """2 x multiply-adds of every Conv2d and Linear for one image, in call order (BN, ReLU, pooling,
    biases ignored).

    Shapes come from one forward pass of a meta tensor with hooks: no real compute, no profiler.
    """
    flops: list[int] = []

    def hook(m, inp, out):
        if isinstance(m, nn.Conv2d):
            macs_per_out = (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
        else:
            macs_per_out = m.in_features
        flops.append(2 * out.numel() * macs_per_out)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(torch.empty(1, 3, image_size, image_size, device="meta"))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return flops


def count_forward_flops(model: nn.Module, image_size: int) -> int:
    """Forward FLOPs of one image: the sum of `layer_flops`."""
    return sum(layer_flops(model, image_size))


class VisionWorkload(Workload):
    kind = "vision"

    def __init__(self, cfg: WorkloadConfig, data: DataConfig):
        super().__init__(cfg, data)
        self._flops: float | None = None
        self._first_layer_flops = 0.0
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.channels_last = use_channels_last(cfg.channels_last, device_type)
        self.cudnn_benchmark = use_cudnn_benchmark(cfg.cudnn_benchmark, device_type)
        self._data_facts: dict = {}
        self._image_sets: tuple = ()

    def build_model(self) -> nn.Module:
        c = self.cfg
        # workload.dropout: VGG's classifier dropout (torchvision: 0.5); 0 makes runs comparable across
        # pipelines, whose micro-batching draws dropout masks in a different order. ResNet has none.
        model = build_vision_model(c.arch, c.num_classes, c.image_size, c.width_div, c.dropout)
        torch.backends.cudnn.benchmark = self.cudnn_benchmark  # process-wide: this rank's convolutions
        if not self.channels_last:
            return model
        # channels_last activations: the first convolution's input is made NHWC (a hook on that module, so
        # the pipelines' sequential form has it too) and cuDNN/oneDNN then keep every activation NHWC.
        # The weights follow where the adapter accepts strided parameters (DDP, pipelines): else (ZeRO,
        # FSDP2, Horovod flatten or shard them into contiguous buffers) they stay NCHW
        first_conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
        first_conv.register_forward_pre_hook(_channels_last_input)
        return model.to(memory_format=torch.channels_last) if self.channels_last_weights else model

    def describe(self) -> dict:
        d = self.data
        # channels_last_weights: the weights too (false: activations only, the adapter needs contiguous weights)
        facts = {
            "channels_last": self.channels_last,
            "channels_last_weights": self.channels_last and self.channels_last_weights,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,  # as this process runs (workload.cudnn_benchmark)
        }
        if d.source == "imagefolder":
            facts.update(decoder=d.decoder, cache_decoded=d.cache_decoded, **self._data_facts)
            # this rank's files that could not be decoded (data.bad_images=skip; fail ends the run at the first)
            sets = self._image_sets
            facts.update(
                bad_images=d.bad_images,
                images_skipped=sum(s.skipped() for s in sets),
                images_skipped_files=[f for s in sets for f in s.skipped_files()][:10],
            )
        return facts

    def sequential(self, model: nn.Module) -> nn.Sequential:
        return vision_sequential(model)

    def forward_flops_per_sample(self) -> float:
        """Forward FLOPs of one image at workload.image_size. Convention: 2 FLOPs per multiply-add,
        Conv2d and Linear layers only (BatchNorm, ReLU, pooling, biases ignored)."""
        if self._flops is None:
            c = self.cfg
            with torch.device("meta"):
                model = build_vision_model(c.arch, c.num_classes, c.image_size, c.width_div)
            per_layer = layer_flops(model, c.image_size)
            self._flops, self._first_layer_flops = float(sum(per_layer)), float(per_layer[0])
        return self._flops

    def train_flops_per_sample(self) -> float:
        """3 x forward less the first convolution's input gradient, which autograd never computes (the
        image needs no gradient): backward = 2 x forward for every other layer (its input and weight
        gradients). What torch's FlopCounterMode counts too (ptbench.core.flops.count_train_flops)."""
        forward = self.forward_flops_per_sample()
        return 3.0 * forward - self._first_layer_flops

    def example_batch(self, n: int, device="meta") -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        x = torch.empty((n, 3, c.image_size, c.image_size), device=device)
        return x, torch.zeros(n, dtype=torch.int64, device=device)

    # --- data --------------------------------------------------------------------------------
    def check_data(self) -> None:
        root = self.real_data_root("imagefolder", "vision", "train/ and val/")
        if root is None:
            return
        for split in ("train", "val"):
            if not (Path(root) / split).is_dir():
                raise ConfigError(
                    f"data.root: {root} has no {split}/ folder; set data.root=<folder with train/ "
                    "and val/ class folders> or BENCH_DATA_ROOT"
                )
            n = len(D.class_folders(Path(root) / split))
            if n != self.cfg.num_classes:
                raise ConfigError(
                    f"data.root: {Path(root) / split} has {n} class folders but "
                    f"workload.num_classes={self.cfg.num_classes}; set workload.num_classes={n}"
                )
        if self.data.bad_images not in D.BAD_IMAGES:
            raise ConfigError(f"data.bad_images={self.data.bad_images}: choose {' or '.join(D.BAD_IMAGES)}")
        if self.data.decoder not in D.DECODERS:
            raise ConfigError(f"data.decoder={self.data.decoder}: choose {' or '.join(D.DECODERS)}")
        if self.data.cache_decoded:
            if self.data.decoder != "torchvision":
                raise ConfigError(
                    "data.cache_decoded=true needs data.decoder=torchvision (the PIL path decodes per item)"
                )
            import psutil

            need = sum(D.decoded_bytes_estimate(Path(root) / split, self.data.bad_images) for split in ("train", "val"))
            free = psutil.virtual_memory().available
            if need > free / 4:  # per rank: every rank of a node holds its own cache
                raise ConfigError(
                    f"data.cache_decoded: the decoded images of {root} need ~{need / 2**30:.1f} GiB per "
                    f"rank, over a quarter of the {free / 2**30:.1f} GiB free; set data.cache_decoded=false"
                )

    def datasets(self, local_rank: int = 0):
        """(train, val): items (image [3, image_size, image_size] float32, label int64).

        synthetic: `SyntheticImages` (data.train_samples / data.val_samples images).
        imagefolder: <root>/train (reference train transforms if data.augment) and <root>/val
        (Resize(image_size / 0.875) + CenterCrop), decoded by data.decoder, kept decoded in RAM with
        data.cache_decoded (its build time and bytes are recorded via `describe`). `local_rank` is unused.
        """
        self.check_data()
        c, d = self.cfg, self.data
        if d.source == "synthetic":
            return (
                D.SyntheticImages(d.train_samples, c.num_classes, c.image_size, "train"),
                D.SyntheticImages(d.val_samples, c.num_classes, c.image_size, "val"),
            )
        sets = tuple(
            D.image_folder(d.root, split, c.image_size, d.augment, d.decoder, d.cache_decoded, d.bad_images)
            for split in ("train", "val")
        )
        self._image_sets = sets  # their damaged-file counts go into the record (`describe`)
        if d.cache_decoded:
            self._data_facts = {
                "cache_build_s": sum(s.cache_time_s for s in sets),
                "cache_bytes": sum(s.cache_bytes for s in sets),
            }
        return sets
