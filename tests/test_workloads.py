"""Workloads: exact GPT-2 sizes and logits (vs Hugging Face), pipeline forms, FLOPs, and data."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ptbench.core.config import DataConfig, WorkloadConfig
from ptbench.core.errors import ConfigError
from ptbench.workloads import build_workload
from ptbench.workloads import data as D
from ptbench.workloads.gpt2 import GPT2, CausalSelfAttention, GPT2Config, qkv_from_hf, qkv_to_hf
from ptbench.workloads.vision import NarrowResNet, build_vision_model

CONF = Path(__file__).resolve().parents[1] / "conf" / "workload"


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # much faster than 2 threads on a shared 2-core machine
    yield
    torch.set_num_threads(n)


def wcfg(name: str, **over) -> WorkloadConfig:
    """The shipped conf/workload/<name>.yaml as a WorkloadConfig, with overrides."""
    import yaml

    d = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    d.update(over)
    return WorkloadConfig(**d)


def nparams(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())  # shared (tied) parameters counted once


def stack(ds) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*[ds[i] for i in range(len(ds))])
    return torch.stack(xs), torch.stack(ys)


# --------------------------------------------------------------------------------------------
# GPT-2 model
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,expected", [("gpt2_small", 124_439_808), ("gpt2_medium", 354_823_168)])
def test_gpt2_parameter_counts(name, expected):
    w = build_workload(wcfg(name), DataConfig())
    with torch.device("meta"):
        model = w.build_model()
    assert model.lm_head.weight is model.wte.weight
    assert nparams(model) == expected


def test_gpt2_module_names_and_init():
    model = build_workload(wcfg("gpt2_tiny"), DataConfig()).build_model()
    names = dict(model.named_modules())
    for n in [
        "wte",
        "wpe",
        "drop",
        "ln_f",
        "lm_head",
        "blocks.1.ln_1",
        "blocks.1.attn.c_attn",
        "blocks.1.attn.c_proj",
        "blocks.1.ln_2",
        "blocks.1.mlp.c_fc",
        "blocks.1.mlp.c_proj",
    ]:
        assert n in names, n
    # GPT-2 init: normal(0, 0.02); residual projections 0.02 / sqrt(2 * n_layer)
    assert abs(model.blocks[0].mlp.c_fc.weight.std().item() - 0.02) < 0.001
    assert abs(model.blocks[0].mlp.c_proj.weight.std().item() - 0.02 / (2 * 2) ** 0.5) < 0.001


def _randomize(model: nn.Module) -> None:
    """Non-trivial values everywhere (init leaves biases 0 and LayerNorm 1/0, hiding mapping bugs)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            is_ln_weight = name.split(".")[-2].startswith("ln_") and name.endswith("weight")
            p.copy_(1 + 0.1 * noise if is_ln_weight else 0.05 * noise)


def _to_hf(model: GPT2, c: GPT2Config):
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel(
        HFConfig(
            vocab_size=c.vocab_size,
            n_positions=c.seq_len,
            n_embd=c.n_embd,
            n_layer=c.n_layer,
            n_head=c.n_head,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            layer_norm_epsilon=1e-5,
            activation_function="gelu_new",
        )
    )
    sd = {
        "transformer.wte.weight": model.wte.weight,
        "transformer.wpe.weight": model.wpe.weight,
        "transformer.ln_f.weight": model.ln_f.weight,
        "transformer.ln_f.bias": model.ln_f.bias,
        "lm_head.weight": model.lm_head.weight,
    }
    for i, b in enumerate(model.blocks):
        h = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            sd[h + ln + ".weight"], sd[h + ln + ".bias"] = getattr(b, ln).weight, getattr(b, ln).bias
        # HF Conv1D stores weight as [in, out]; HF's c_attn columns are [q | k | v]
        sd[h + "attn.c_attn.weight"] = qkv_to_hf(b.attn.c_attn.weight, c.n_head).t()
        sd[h + "attn.c_attn.bias"] = qkv_to_hf(b.attn.c_attn.bias, c.n_head)
        for lin in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            mod = b.get_submodule(lin)
            sd[h + lin + ".weight"], sd[h + lin + ".bias"] = mod.weight.t(), mod.bias
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    assert not unexpected
    assert not [k for k in missing if k in dict(hf.named_parameters())], missing  # only buffers may be absent
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    return hf.eval()


@pytest.mark.parametrize(
    "dims,T",
    [
        (dict(n_layer=2, n_head=4, n_embd=128, seq_len=64), 64),
        (dict(n_layer=12, n_head=12, n_embd=768, seq_len=1024), 16),
    ],
    ids=["tiny", "gpt2_small_dims"],
)
def test_gpt2_logits_match_huggingface(dims, T):
    c = GPT2Config(vocab_size=50257, dropout=0.0, **dims)
    torch.manual_seed(0)
    model = GPT2(c).eval()
    _randomize(model)
    hf = _to_hf(model, c)
    if c.n_layer == 12:
        assert nparams(hf) == 124_439_808
    idx = torch.randint(0, c.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    assert ours.shape == (2, T, c.vocab_size)
    assert ours.abs().max() > 1.0  # not a comparison of near-zero numbers
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_qkv_layout_is_tensor_parallel_friendly():
    """A colwise shard of c_attn + rowwise shard of c_proj (whole heads per rank) reproduces the
    attention with the unchanged forward on each shard: what ColwiseParallel/RowwiseParallel do."""
    c = GPT2Config(vocab_size=64, seq_len=16, n_layer=1, n_head=4, n_embd=32)
    torch.manual_seed(0)
    attn = CausalSelfAttention(c).eval()
    _randomize(attn)
    x = torch.randn(2, 16, 32)
    full = attn(x)
    tp, d = 2, c.n_embd
    partial = torch.zeros_like(full)
    for r in range(tp):
        shard = CausalSelfAttention(c).eval()
        rows = slice(r * 3 * d // tp, (r + 1) * 3 * d // tp)
        cols = slice(r * d // tp, (r + 1) * d // tp)
        shard.c_attn = nn.Linear(d, 3 * d // tp)
        shard.c_proj = nn.Linear(d // tp, d, bias=False)
        with torch.no_grad():
            shard.c_attn.weight.copy_(attn.c_attn.weight[rows])
            shard.c_attn.bias.copy_(attn.c_attn.bias[rows])
            shard.c_proj.weight.copy_(attn.c_proj.weight[:, cols])
            partial += shard(x)
    torch.testing.assert_close(partial + attn.c_proj.bias, full, atol=1e-6, rtol=1e-5)
    w = torch.randn(96, 32)
    assert torch.equal(qkv_from_hf(qkv_to_hf(w, 4), 4), w) and not torch.equal(qkv_to_hf(w, 4), w)


def test_gpt2_flops_convention():
    w = build_workload(wcfg("gpt2_small"), DataConfig())
    f = w.forward_flops_per_sample()
    assert f == 291_648_307_200  # 2 * (L (12 d^2 + 2 T d) + d V) * T
    # ~ 2 * (non-embedding params + lm_head) + full-T attention, per token: within 0.5 %
    L, d, T, V = 12, 768, 1024, 50257
    rule = 2 * (85_054_464 + d * V) + 4 * L * T * d
    assert abs(f / T / rule - 1) < 0.005
    assert w.tokens_per_sample() == 1024 and w.train_flops_per_sample() == 3 * f


# --------------------------------------------------------------------------------------------
# sequential forms, vision models, FLOPs
# --------------------------------------------------------------------------------------------
def _same_params(seq: nn.Module, model: nn.Module) -> bool:
    return {id(p) for p in seq.parameters()} == {id(p) for p in model.parameters()}


def test_gpt2_sequential_matches_model():
    w = build_workload(wcfg("gpt2_tiny"), DataConfig())
    torch.manual_seed(0)
    model = w.build_model().eval()
    seq = w.sequential(model)
    assert len(seq) == 2 + 2
    assert _same_params(seq, model)
    assert seq.head.lm_head.weight is seq.embed.wte.weight
    for a, b in w.tied_parameters(sequential=True):
        assert seq.get_parameter(a) is seq.get_parameter(b)
    idx = torch.randint(0, 50257, (2, 24))
    with torch.no_grad():
        assert torch.equal(seq(idx), model(idx))


@pytest.mark.parametrize("name", ["vgg16_tiny", "resnet50_tiny"])
def test_vision_sequential_matches_model(name):
    w = build_workload(wcfg(name), DataConfig())
    torch.manual_seed(0)
    model = w.build_model().eval()
    seq = w.sequential(model)
    assert len(seq) == (40 if name.startswith("vgg") else 23)
    assert _same_params(seq, model)
    assert not any(isinstance(m, nn.ReLU) and m.inplace for m in model.modules())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        assert out.shape == (2, 10)
        assert torch.equal(seq(x), out)


@pytest.mark.parametrize(
    "arch,layers,params,gmacs", [("vgg16", 40, 138_357_544, 15.47), ("resnet50", 23, 25_557_032, 4.089)]
)
def test_full_vision_models_structure_and_flops(arch, layers, params, gmacs):
    """Reference numbers: torchvision's own weight metadata (num_params, _ops in GMACs)."""
    w = build_workload(wcfg(arch), DataConfig())
    with torch.device("meta"):
        model = w.build_model()
    assert nparams(model) == params
    assert len(w.sequential(model)) == layers
    assert abs(w.forward_flops_per_sample() / 2e9 / gmacs - 1) < 0.005


def test_narrow_variants_divide_every_width():
    r = build_vision_model("resnet50", 10, 32, width_div=8)
    assert r.conv1.out_channels == 8 and r.layer4[-1].conv3.out_channels == 256 and r.fc.in_features == 256
    assert [len(getattr(r, f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]
    v = build_vision_model("vgg16", 10, 32, width_div=8)
    convs = [m.out_channels for m in v.features if isinstance(m, nn.Conv2d)]
    assert convs == [8, 8, 16, 16, 32, 32, 32, 64, 64, 64, 64, 64, 64]
    assert v.classifier[0].in_features == 64 and v.classifier[3].in_features == 512
    with torch.device("meta"):  # the narrow construction at width 1 is torchvision's ResNet-50
        assert nparams(NarrowResNet(1, 1000)) == 25_557_032


# --------------------------------------------------------------------------------------------
# Wikitext and the token cache
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_dir(data_root):
    return data_root / "gpt2-tokenizer"


def test_tokenizer_hello_world(tokenizer_dir):
    assert D.gpt2_tokenizer(tokenizer_dir).encode("Hello world").ids == [15496, 995]


def test_chunked_encoding_equals_whole_file_encoding(data_root, tokenizer_dir):
    tok = D.gpt2_tokenizer(tokenizer_dir)
    text = (data_root / "wikitext-2" / "valid.txt").read_text(encoding="utf-8")[:200_000]
    ids = D.encode_text(tok, text, chunk_chars=300)  # hundreds of chunk boundaries
    assert ids.tolist() == tok.encode(text).ids


def test_wikitext_valid_tokens_decode_and_cache_reuse(data_root, tokenizer_dir, tmp_path):
    text_path = data_root / "wikitext-2" / "valid.txt"
    path = D.token_cache(text_path, tokenizer_dir, cache_dir=str(tmp_path))
    ids = D.load_tokens(path)
    assert len(ids) == 258_659  # the README's figure
    tok = D.gpt2_tokenizer(tokenizer_dir)
    assert tok.decode(ids.tolist()) == text_path.read_text(encoding="utf-8")
    mtime = path.stat().st_mtime_ns
    again = D.token_cache(text_path, tokenizer_dir, cache_dir=str(tmp_path))
    assert again == path and path.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp files left behind


def test_wikitext_workload_datasets(data_root, tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("BENCH_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "wt"
    root.mkdir()
    os.symlink(data_root / "wikitext-2" / "valid.txt", root / "valid.txt")
    (root / "train.txt").write_text((data_root / "wikitext-2" / "valid.txt").read_text()[:60_000])  # small stand-in
    w = build_workload(
        wcfg("gpt2_tiny"), DataConfig(source="wikitext", root=str(root), tokenizer_dir=str(tokenizer_dir))
    )
    w.check_data()
    train, val = w.datasets()
    cache = tmp_path / "xdg" / "trainbench"  # the default cache location: the user's, not the data folder
    assert not (root / ".bench_cache").exists()
    assert len(list(cache.glob("*.u16"))) == 2
    T = w.tokens_per_sample()
    assert len(val) == 258_659 // (T + 1) and 0 < len(train) < len(val) // 10
    x, y = val[0]
    assert x.shape == y.shape == (T,) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])
    all_ids = D.load_tokens(next(cache.glob("wt.valid.txt.*.u16")))
    assert val[1][0].tolist() == all_ids[T + 1 : 2 * T + 1].tolist()  # non-overlapping blocks of T + 1
    tok = D.gpt2_tokenizer(tokenizer_dir)
    text = (data_root / "wikitext-2" / "valid.txt").read_text(encoding="utf-8")
    assert text.startswith(tok.decode(x.tolist() + [int(y[-1])]))
    # another rank finds the finished caches without building
    _, v2 = w.datasets(local_rank=1)
    assert len(v2) == len(val) and torch.equal(v2[3][0], val[3][0])


def test_cache_falls_back_to_user_cache_when_root_not_writable(tmp_path, tokenizer_dir, monkeypatch):
    """Two data roots where <root>/.bench_cache cannot be made, for real (the tests run as root, which
    ignores permission bits): /proc, and a folder where a regular file already holds that name."""
    monkeypatch.delenv("BENCH_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    user_cache = tmp_path / "xdg" / "trainbench"
    assert not D._writable_dir(Path("/proc/.bench_cache")) and D._writable_dir(tmp_path / "fine")

    path = D.token_cache("/proc/version", tokenizer_dir)  # a readable text in a read-only file system
    assert path.parent == user_cache and D.load_tokens(path).size > 0
    assert not Path("/proc/.bench_cache").exists()

    root = tmp_path / "data"
    root.mkdir()
    (root / ".bench_cache").write_text("not a folder")
    text = root / "train.txt"
    text.write_text(" = Title = \n \n Some words here . \n")
    path = D.token_cache(text, tokenizer_dir)
    assert path.parent == user_cache
    assert D.load_tokens(path).tolist() == D.gpt2_tokenizer(tokenizer_dir).encode(text.read_text()).ids
    text.write_text(" = Title = \n \n Other words . \n")  # a changed file gets a new cache entry
    assert D.token_cache(text, tokenizer_dir) != path
    assert (root / ".bench_cache").read_text() == "not a folder"


def test_other_ranks_wait_for_the_builder(tmp_path, tokenizer_dir):
    text = tmp_path / "valid.txt"
    text.write_text(" a b c \n" * 1000)
    cache = str(tmp_path / "c")
    with pytest.raises(TimeoutError):
        D.token_cache(text, tokenizer_dir, cache_dir=cache, local_rank=1, wait_s=0.6)
    got = {}
    waiter = threading.Thread(
        target=lambda: got.setdefault("p", D.token_cache(text, tokenizer_dir, cache_dir=cache, local_rank=1, wait_s=30))
    )
    waiter.start()
    time.sleep(0.3)
    built = D.token_cache(text, tokenizer_dir, cache_dir=cache, local_rank=0)
    waiter.join(timeout=30)
    assert got["p"] == built


# --------------------------------------------------------------------------------------------
# ImageFolder
# --------------------------------------------------------------------------------------------
def test_imagefolder_cifar10_subset(data_root):
    data = DataConfig(source="imagefolder", root=str(data_root / "cifar10-subset"), augment=True)
    w = build_workload(wcfg("resnet50_tiny"), data)
    w.check_data()
    train, val = w.datasets()
    assert (len(train), len(val)) == (5000, 1000)
    assert len(train.classes) == 10 and train.classes == val.classes and train.classes[0] == "airplane"
    x, label = train[123]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= label < 10
    assert torch.equal(val[5][0], val[5][0])  # val transform is deterministic
    assert abs(float(torch.stack([val[i][0] for i in range(0, 1000, 50)]).mean())) < 1.0  # normalized
    bad = build_workload(wcfg("resnet50_tiny", num_classes=100), data)
    with pytest.raises(ConfigError, match="workload.num_classes") as e:
        bad.check_data()
    assert "\n" not in str(e.value)


def _items(dataset, indices, seed):
    torch.manual_seed(seed)  # the train transforms draw their crops and flips from torch's global RNG
    return torch.stack([dataset[i][0] for i in indices])


def test_decoded_and_cached_images_match_the_reference_path(data_root):
    """torchvision.io decoding (with and without the RAM cache) gives the reference (PIL) path's tensors:
    the cache bit for bit, PIL within one uint8 level (its resize rounds differently), same seed."""
    root, idx = data_root / "cifar10-subset", [0, 7, 99, 100, 500, 999]
    one_level = 1.0001 / 255 / min(D.IMAGENET_STD)  # one uint8 step after normalisation
    for split, augment in (("train", True), ("val", True), ("train", False)):
        pil = D.image_folder(root, split, 32, augment, decoder="pil")
        tv = D.image_folder(root, split, 32, augment, decoder="torchvision")
        cached = D.image_folder(root, split, 32, augment, decoder="torchvision", cache_decoded=True)
        assert tv.samples == pil.samples and cached.classes == pil.classes
        assert cached.cache_bytes == len(cached) * 3 * 32 * 32 and cached.cache_time_s > 0
        ref = _items(pil, idx, seed=3)
        assert torch.equal(_items(tv, idx, seed=3), _items(cached, idx, seed=3))
        got = _items(cached, idx, seed=3)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        assert (got - ref).abs().max() <= one_level, (split, augment, float((got - ref).abs().max()))
        if split == "train" and augment:  # another seed, other crops: the comparison is not vacuous
            assert (_items(cached, idx, seed=4) - ref).abs().max() > 10 * one_level
    # CropFlip is torchvision's RandomResizedCrop + RandomHorizontalFlip on uint8 tensors, bit for bit
    ref_tf, images = D.imagenet_transforms(32, train=True, uint8=True), cached.images[:50]
    for seed in (0, 1):
        torch.manual_seed(seed)
        want = [ref_tf(im).float() for im in images]
        torch.manual_seed(seed)
        assert all(torch.equal(D.CropFlip(32)(im), w) for im, w in zip(images, want))
    data = DataConfig(source="imagefolder", root=str(root), decoder="pil", cache_decoded=True)
    with pytest.raises(ConfigError, match="data.decoder=torchvision"):
        build_workload(wcfg("resnet50_tiny"), data).check_data()


# --------------------------------------------------------------------------------------------
# synthetic data: deterministic and learnable
# --------------------------------------------------------------------------------------------
def test_synthetic_tokens_deterministic():
    torch.manual_seed(1)
    a = D.MarkovTokens(8, 32, 50257, "train")
    torch.manual_seed(2)
    b = D.MarkovTokens(8, 32, 50257, "train")
    v = D.MarkovTokens(8, 32, 50257, "val")
    assert torch.equal(a.seqs, b.seqs) and not torch.equal(a.seqs, v.seqs)
    x, y = a[0]
    assert x.shape == y.shape == (32,) and x.dtype == torch.int64 and torch.equal(x[1:], y[:-1])
    assert len(torch.unique(a.seqs)) <= 256


def test_synthetic_tokens_learnable():
    w = build_workload(wcfg("gpt2_tiny", vocab_size=512, seq_len=32), DataConfig(train_samples=640, val_samples=64))
    torch.manual_seed(0)
    model = w.build_model()
    train, val = w.datasets()
    xv, yv = stack(val)

    def val_loss():
        with torch.no_grad():
            return w.loss(model(xv), yv).item()

    before = val_loss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in torch.utils.data.DataLoader(train, batch_size=16, shuffle=True):
        loss = w.loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = val_loss()
    assert before > 6.0 and after < before - 1.0, (before, after)


def test_synthetic_images_deterministic_and_learnable():
    a = D.SyntheticImages(300, 10, 32, "train")
    b = D.SyntheticImages(300, 10, 32, "train")
    assert torch.equal(a[7][0], b[7][0]) and a[7][1] == b[7][1]
    assert a[1][0].shape == (3, 32, 32) and a[1][0].dtype == torch.float32
    assert D.SyntheticImages(2, 10, 224, "val")[0][0].shape == (3, 224, 224)
    w = build_workload(wcfg("vgg16_tiny"), DataConfig(train_samples=512, val_samples=256))
    train, val = w.datasets()
    (X, Y), (Xv, Yv) = stack(train), stack(val)
    torch.manual_seed(0)
    lin = nn.Linear(3 * 32 * 32, 10)
    opt = torch.optim.Adam(lin.parameters(), lr=1e-3)
    for _ in range(30):
        loss = F.cross_entropy(lin(X.flatten(1)), Y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    acc = (lin(Xv.flatten(1)).argmax(1) == Yv).float().mean().item()
    assert acc > 0.5  # chance is 0.1


# --------------------------------------------------------------------------------------------
# configuration errors: one line naming the key
# --------------------------------------------------------------------------------------------
def _err(workload: str, data: DataConfig) -> str:
    with pytest.raises(ConfigError) as e:
        build_workload(wcfg(workload), data).check_data()
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_check_data_errors_name_the_key(tmp_path, tokenizer_dir):
    msg = _err("gpt2_tiny", DataConfig(source="wikitext", root="/nonexistent/wt", tokenizer_dir=str(tokenizer_dir)))
    assert msg.startswith("data.root") and "/nonexistent/wt" in msg and "train.txt" in msg
    assert _err("gpt2_tiny", DataConfig(source="wikitext", root=None)).startswith("data.root")
    (tmp_path / "train.txt").write_text("x")
    (tmp_path / "valid.txt").write_text("x")
    msg = _err("gpt2_tiny", DataConfig(source="wikitext", root=str(tmp_path), tokenizer_dir=str(tmp_path)))
    assert msg.startswith("data.tokenizer_dir") and "vocab.json" in msg
    msg = _err("resnet50_tiny", DataConfig(source="imagefolder", root=str(tmp_path / "nope")))
    assert msg.startswith("data.root") and "train/" in msg
    assert "data.source" in _err("resnet50_tiny", DataConfig(source="wikitext"))
    assert "data.source" in _err("gpt2_tiny", DataConfig(source="imagefolder"))
