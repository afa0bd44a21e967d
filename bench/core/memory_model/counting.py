"""What autograd really saves, counted on the meta device (no memory, no FLOPs) with the memory ledger's
instrument (ptbench.core.memory.SavedTensorLedger): the counted side of the activations (README.md, "Activations,
the harness GPT-2" and "Activations, vision"). Each function imports torch when called."""

from __future__ import annotations

import contextlib
import copy


def activation_elements(model, sample_shape, dtype=None) -> float:
    """What autograd really saves for backward for ONE sample of `sample_shape` (without the batch
    dimension), in fp32 elements (bytes / 4): a forward on the meta device (no memory, no FLOPs) under
    `torch.autograd.graph.saved_tensors_hooks`, counting each saved tensor's storage once (a view and its
    base, or one tensor saved by two consumers, are one storage), parameters and buffers excluded. Max-pool
    indices (int64), BatchNorm's statistics and residual adds count as saved; an output nobody saves (a
    leaf module's output that is only an input to an in-place op or a view) does not. `model` must be on the
    meta device (build it under `torch.device("meta")`)."""
    import torch

    from ptbench.core.memory import SavedTensorLedger

    # two samples, halved: BatchNorm in training mode refuses one value per channel (a 1x1 map)
    x = torch.empty((2, *sample_shape), device="meta", dtype=dtype or torch.float32)
    with torch.enable_grad(), SavedTensorLedger([model]) as ledger:
        out = model(x)
        saved = ledger.total
        del out
    return saved / 4 / 2


def pipeline_layers(model) -> list:
    """A vision model's layers in the order its pipeline form runs them (the same list as workloads/vision.py
    `vision_sequential`, tests check it): top-level children in order, nn.Sequential children expanded, a
    Flatten before the first Linear."""
    from torch import nn

    layers, flat = [], False
    for child in model.children():
        for m in child if isinstance(child, nn.Sequential) else [child]:
            if isinstance(m, nn.Linear) and not flat:
                layers.append(nn.Flatten(1))
            flat = flat or isinstance(m, (nn.Linear, nn.Flatten))
            layers.append(m)
    return layers


def even_split(layers: int, stages: int) -> list[int]:
    """Layers per stage by count; the first `layers % stages` stages take one more (adapters/_pipeline.py's)."""
    q, r = divmod(layers, stages)
    return [q + (i < r) for i in range(stages)]


def stage_input_elements(model, sample_shape, balance: list[int]) -> list[float]:
    """Per sample, the elements of each pipeline stage's input (layers per stage: `balance`; meta device):
    what torchgpipe's checkpointing keeps of each micro-batch."""
    import torch
    from torch import nn

    layers = pipeline_layers(model)
    x = torch.empty((2, *sample_shape), device="meta")
    out, start = [], 0
    for n in balance:
        out.append(x.numel() / 2)
        with torch.no_grad():
            x = nn.Sequential(*layers[start : start + n])(x)
        start += n
    return out


def stage_activation_elements(model, sample_shape, balance: list[int]) -> list[float]:
    """`activation_elements` of each pipeline stage (layers per stage: `balance`): each stage counted on its
    own, its input a tensor that requires grad as a received activation does (its first op saves it)."""
    import torch
    from torch import nn

    from ptbench.core.memory import SavedTensorLedger

    layers = pipeline_layers(model)
    if sum(balance) != len(layers):
        raise ValueError(f"balance {balance} does not cover the model's {len(layers)} layers")
    x = torch.empty((2, *sample_shape), device="meta")
    out, start = [], 0
    for i, n in enumerate(balance):
        stage = nn.Sequential(*layers[start : start + n])
        start += n
        x = x.detach().requires_grad_(i > 0)
        with torch.enable_grad(), SavedTensorLedger([model]) as ledger:
            y = stage(x)
            out.append(ledger.total / 4 / 2)
        x = y
    return out


def _block_quadratic(block, b: int, h: int, seq_len: int, scores: bool) -> float:
    """What one block saves per sample at seq_len tokens, from the CPU at 4, 8 and 16 tokens: on the meta device
    scaled_dot_product_attention runs its math form (which keeps the s x s scores); the CPU's flash kernel keeps
    the output and a log-sum-exp, as CUDA's fused kernels do (with dropout > 0 the CPU keeps s x s terms too).
    What a block saves is a quadratic in the tokens, so three small token counts give it exactly at seq_len."""
    import torch

    from ptbench.core.memory import SavedTensorLedger

    def block_elements(tokens: int) -> float:
        xs = torch.zeros((b, tokens, h), requires_grad=True)
        with torch.enable_grad(), SavedTensorLedger([block]) as ledger:
            block(xs)
            return ledger.total / 4 / b

    t1, t2, t3 = 4, 8, 16
    y1, y2, y3 = (block_elements(t) for t in (t1, t2, t3))
    c2 = ((y3 - y2) / (t3 - t2) - (y2 - y1) / (t2 - t1)) / (t3 - t1)
    c1 = (y2 - y1) / (t2 - t1) - c2 * (t1 + t2)
    c0 = y1 - c1 * t1 - c2 * t1 * t1
    return c0 + c1 * seq_len + (c2 * seq_len * seq_len if scores else 0.0)


def tp_local_block(block, tp: int):
    """A copy of the harness GPT-2's `block` as one of `tp` tensor-parallel ranks runs it (adapters/
    tensor_parallel.py's plan): c_attn and mlp.c_fc cut by columns (ColwiseParallel: its 1/t of the heads and of
    the MLP's width), attn.c_proj and mlp.c_proj by rows (RowwiseParallel, their outputs all-reduced whole);
    LayerNorms and dropouts whole. Its saved tensors are the rank's: the attention of its heads, the MLP's 1/t,
    and the replicated LayerNorm inputs, linear inputs and dropout masks."""
    from torch import nn

    block = copy.deepcopy(block)
    if tp == 1:
        return block
    h, dev = block.ln_1.normalized_shape[0], block.ln_1.weight.device
    block.attn.c_attn = nn.Linear(h, 3 * h // tp, device=dev)
    block.attn.c_proj = nn.Linear(h // tp, h, device=dev)
    block.mlp.c_fc = nn.Linear(h, 4 * h // tp, device=dev)
    block.mlp.c_proj = nn.Linear(4 * h // tp, h, device=dev)
    return block


def gpt2_saved_elements(model, seq_len: int, scores: bool = True, tp: int = 1) -> dict | None:
    """What the harness GPT-2 (workloads/gpt2.py: wte, wpe, drop, blocks, ln_f, lm_head) saves per sample,
    counted by `SavedTensorLedger` in fp32 elements (embeddings and head on the meta device, one block on the
    CPU, `_block_quadratic`): {layer (one block), embed (the embeddings and their dropout), head (final LayerNorm
    and the tied head's input), tp}. None for another model. scores=False leaves out the s x s terms the CPU keeps
    with attention dropout (CUDA's kernels fuse it). tp > 1: the block of one tensor-parallel rank
    (`tp_local_block`); the embedding and the head save whole tensors there too."""
    import torch

    from ptbench.core.memory import SavedTensorLedger

    if not all(hasattr(model, n) for n in ("wte", "wpe", "drop", "blocks", "ln_f", "lm_head")):
        return None
    b = 2
    idx = torch.zeros((b, seq_len), dtype=torch.int64, device="meta")

    def count(fn, *args) -> float:
        with torch.enable_grad(), SavedTensorLedger([model]) as ledger:
            fn(*args)
            return ledger.total / 4 / b

    h = model.wte.embedding_dim
    x = torch.empty((b, seq_len, h), device="meta", requires_grad=True)
    block = tp_local_block(model.blocks[0], tp).to_empty(device="cpu")
    layer = _block_quadratic(block, b, h, seq_len, scores)
    return {
        "tp": tp,
        "embed": count(lambda: model.drop(model.wte(idx) + model.wpe(torch.arange(seq_len, device="meta")))),
        "layer": layer,
        "head": count(lambda: model.lm_head(model.ln_f(x))),
    }


def gpt2_saved_bytes_cuda_autocast(model, seq_len: int, dtype_name: str = "bf16", tp: int = 1) -> dict | None:
    """What the harness GPT-2 saves per sample on CUDA under autocast, in BYTES, counted with fake "cuda"
    tensors (no GPU needed; forward only, which is all that is counted): {layer, embed, head}, as
    `gpt2_saved_elements`. Under CUDA autocast LayerNorm runs and saves in fp32 (the residual stream stays
    fp32), each linear saves its own half-precision copy of its weight, dropout masks are 1-byte bools and the
    flash kernel keeps the output and a log-sum-exp: a CPU count in fp32 halved misses all four (8.5-20 %
    under). Each part per sample, and `{part}_fixed` per forward (the weights' half copies). SDPA cannot pick a kernel for a fake device, so the count calls the flash kernel an H100/H200
    runs. tp > 1: the block of one tensor-parallel rank (`tp_local_block`). None for another model."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ptbench.core.memory import SavedTensorLedger

    if not all(hasattr(model, n) for n in ("wte", "wpe", "drop", "blocks", "ln_f", "lm_head")):
        return None
    h = model.wte.embedding_dim
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    local = tp_local_block(model.blocks[0], tp)
    with FakeTensorMode(allow_non_fake_inputs=True):
        wte, wpe, drop, block, ln_f, lm_head = (
            _fake_cuda_copy(m) for m in (model.wte, model.wpe, model.drop, local, model.ln_f, model.lm_head)
        )
        with _cuda_autocast(half), _flash_attention():

            def count(fn, b: int) -> float:
                idx = torch.zeros((b, seq_len), dtype=torch.int64, device="cuda")
                x = torch.empty((b, seq_len, h), device="cuda", requires_grad=True)
                with torch.enable_grad(), SavedTensorLedger([wte, wpe, block, ln_f, lm_head]) as ledger:
                    fn(idx, x)
                    return ledger.total

            pos = torch.arange(seq_len, device="cuda")
            parts = {
                "embed": lambda idx, x: drop(wte(idx) + wpe(pos)),
                "layer": lambda idx, x: block(x),
                "head": lambda idx, x: lm_head(ln_f(x)),
            }
            out = {"unit": "bytes", "tp": tp}
            for name, fn in parts.items():
                # at 1 and 2 samples: the weights' half copies (autocast casts each once a forward) do not
                # grow with the batch, the rest does
                one, two = count(fn, 1), count(fn, 2)
                out[name], out[f"{name}_fixed"] = two - one, 2 * one - two
            return out


def _fake_cuda_copy(module):
    """A copy of `module` whose parameters and buffers are new empty tensors on the current fake "cuda" device
    (set in place: to_empty's tensor swap refuses meta parameters that other modules also hold)."""
    import torch

    module = copy.deepcopy(module)
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for name, t in store.items():
                if t is not None:
                    new = torch.empty(t.shape, dtype=t.dtype, device="cuda")
                    store[name] = torch.nn.Parameter(new, t.requires_grad) if store is m._parameters else new
    return module


@contextlib.contextmanager
def _cuda_autocast(dtype):
    """CUDA autocast on a machine without a GPU: `torch.autocast("cuda")` turns itself off there, the flags
    do not."""
    import torch

    was, was_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", was)
        torch.set_autocast_dtype("cuda", was_dtype)


@contextlib.contextmanager
def _flash_attention():
    """torch's SDPA as the flash kernel (what it picks on an sm80+ GPU); dropout is the kernel's own."""
    import torch
    import torch.nn.functional as F

    def flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
        if attn_mask is not None:
            raise ValueError("the flash kernel takes no attention mask")
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]

    orig = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = flash
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig
