"""Model speed: the harness GPT-2 against megatron-core's GPTModel (and Hugging Face's GPT2LMHeadModel,
when transformers is installed) of one size, stepped in interleaved blocks inside one process.

    python -m ptbench.studies.model_speed                       # 4 layers x 256 wide, 8 heads, T=128, batch 8, fp32
    python -m ptbench.studies.model_speed --blocks 7 --n-layer 2
    python -m ptbench.studies.model_speed --profile            # torch.profiler: each model's top ops by self CPU time

Each step is a full train step: forward, loss, backward, AdamW step (zero_grad(set_to_none) first).
What is kept equal, so that the ratio compares models and not set-ups:
  - sizes: layers, width, heads, T, batch; one vocabulary for all three (default 50432 = GPT-2's
    50257 padded to a multiple of 128, which is what Megatron builds anyway), tied embeddings,
    learned positions, dropout 0, fp32, one CPU thread, 1 rank;
  - the loss: mean token cross-entropy over that vocabulary. Each model computes it its own way:
    the harness GPT-2 with its workload's `loss` (what the trainer calls), Megatron's GPTModel with
    its own vocab-parallel cross-entropy (`labels=` given, what the megatron adapter trains with),
    Hugging Face with `F.cross_entropy` on its logits (the generic `Workload.loss`);
  - the optimizer: torch AdamW (lr 1e-3, wd 0.01, the same hyper-parameters and one parameter
    group for all), over each model's unique parameters (the tied embedding once);
  - the data: one fixed random batch, the same for all models;
  - the machine state: blocks interleave A B C A B C ..., warm-up steps excluded, medians reported.
Megatron runs its GPTModel only (no Megatron DDP wrapper, no schedule): a 1-rank gloo group and
`parallel_state` with TP = PP = 1, on CPU through adapters/_megatron_cpu.py as adapters/megatron.py does
(local layer spec, `use_cpu_initialization`, fusions off, an explicit causal mask). `--vocab` is used
as given by all three models (Megatron is not padded further), so pass 50257 to compare unpadded.
CPU only: on a machine with CUDA the CPU shim refuses to act, and a GPU comparison is another study.
Wall-clock medians give the ratio; process CPU time is printed beside them, since a shared machine
(other processes, load average printed) disturbs wall time more than CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

RATIO_LINE = "harness_gpt2/megatron_gpt"


def _adamw(params):
    import torch

    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _harness(n_layer, n_embd, n_head, seq_len, vocab):
    """(model, loss_fn(x, y) -> loss): the harness GPT-2 and its workload's loss."""
    from ptbench.core.config import DataConfig, WorkloadConfig
    from ptbench.workloads.gpt2 import GPT2Workload

    cfg = WorkloadConfig(
        name="gpt2_speed",
        kind="language",
        arch="gpt2",
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        vocab_size=vocab,
        seq_len=seq_len,
        dropout=0.0,
    )
    workload = GPT2Workload(cfg, DataConfig())
    model = workload.build_model()
    return model, lambda x, y: workload.loss(model(x), y)


def _hf(n_layer, n_embd, n_head, seq_len, vocab):
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=seq_len,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
    )
    model = GPT2LMHeadModel(hf_cfg)

    def loss_fn(x, y):
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    return model, loss_fn


@contextlib.contextmanager
def _megatron_world():
    """A 1-rank gloo group (unless one exists) and Megatron's parallel_state with TP = PP = 1, on CPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError(
            f"ptbench.studies.model_speed runs Megatron on 1 rank; the process group has {dist.get_world_size()}"
        )
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        from ptbench.adapters import _megatron_cpu

        _megatron_cpu.enable(announce=False)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield
    finally:
        ps.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()


def _megatron(n_layer, n_embd, n_head, seq_len, vocab):
    """Megatron's GPTModel, local layer spec, built as adapters/megatron.py builds it on CPU."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ptbench.adapters import _megatron_cpu

    config = TransformerConfig(
        num_layers=n_layer,
        hidden_size=n_embd,
        num_attention_heads=n_head,
        ffn_hidden_size=4 * n_embd,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layernorm_epsilon=1e-5,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        # as adapters/megatron.py configures CPU runs (Megatron's fusions default to off)
        use_cpu_initialization=True,
        batch_p2p_sync=False,
        deallocate_pipeline_outputs=True,
    )
    with _megatron_cpu.cuda_to_cpu():
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=vocab,
            max_sequence_length=seq_len,
            pre_process=True,
            post_process=True,
            share_embeddings_and_output_weights=True,
            position_embedding_type="learned_absolute",
        )
    positions = torch.arange(seq_len).unsqueeze(0)
    mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), 1)[None, None]  # True = masked out

    def loss_fn(x, y):
        per_token = model(x, positions.expand(x.shape[0], -1), mask, labels=y)  # Megatron's vocab-parallel CE
        return per_token.float().mean()

    return model, loss_fn


def _stepper(model, loss_fn, x, y) -> Callable[[int], tuple[float, float]]:
    """steps(n) -> (wall seconds, process CPU seconds) per step over n full train steps."""
    model.train()
    params = list(model.parameters())  # unique: a tied weight appears once
    opt = _adamw(params)

    def steps(n: int) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(x, y)
            loss.backward()
            opt.step()
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            raise RuntimeError(f"non-finite loss {loss_value}")
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n

    return steps


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def compare_models(
    n_layer=4,
    n_embd=256,
    n_head=8,
    seq_len=128,
    vocab=50432,
    batch=8,
    blocks=5,
    steps_per_block=3,
    warmup=2,
    hf=None,
    verbose=True,
) -> dict:
    """Median seconds per train step of each model over `blocks` interleaved blocks.

    Returns {"median_s": {name: wall s/step}, "blocks_s": {name: [per block]}, "cpu_median_s" and
    "cpu_blocks_s" (the same in process CPU time), "params": {name: n}, "ratio": harness_gpt2 /
    megatron_gpt (wall medians), "cpu_ratio", "load_before", "load_after" (os.getloadavg), "sizes", ...}.
    `hf`: None = include Hugging Face when transformers is installed; False = never; True = required.
    """
    import torch

    if torch.cuda.is_available():
        raise RuntimeError(
            "ptbench.studies.model_speed compares the models on CPU, and this machine has CUDA, where "
            "adapters/_megatron_cpu.py refuses to patch Megatron; run it on a CPU-only machine"
        )
    torch.set_num_threads(1)
    sizes = {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "seq_len": seq_len, "vocab": vocab, "batch": batch}
    if hf is None:
        hf = importlib.util.find_spec("transformers") is not None
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    dims = (n_layer, n_embd, n_head, seq_len, vocab)

    with warnings.catch_warnings():
        # megatron-core warns at import and spec time that Apex/TE are absent (as adapters/megatron.py filters)
        warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed", category=UserWarning)
        warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
        with _megatron_world():
            return _compare(builders_for(hf), dims, x, y, blocks, steps_per_block, warmup, verbose, sizes)


def builders_for(hf: bool) -> dict:
    builders = {"harness_gpt2": _harness, "megatron_gpt": _megatron}
    if hf:
        builders["hf_gpt2"] = _hf
    return builders


def _compare(builders, dims, x, y, blocks, steps_per_block, warmup, verbose, sizes) -> dict:
    """Build each model (same seed), warm each up, then time them in interleaved blocks."""
    import torch

    models, steppers = {}, {}
    for name, build in builders.items():
        torch.manual_seed(0)
        models[name], loss_fn = build(*dims)
        steppers[name] = _stepper(models[name], loss_fn, x, y)
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    load_before = _load()
    for step in steppers.values():
        if warmup:
            step(warmup)
    per_block = {name: [] for name in steppers}
    cpu_block = {name: [] for name in steppers}
    for b in range(blocks):
        for name, step in steppers.items():
            wall, cpu = step(steps_per_block)
            per_block[name].append(wall)
            cpu_block[name].append(cpu)
        if verbose:
            print(
                f"block {b + 1}/{blocks} (load {_load().split()[0]}): "
                + "  ".join(f"{n} {s[-1]:.3f}s" for n, s in per_block.items()),
                flush=True,
            )
    load_after = _load()
    median = {name: statistics.median(v) for name, v in per_block.items()}
    cpu = {name: statistics.median(v) for name, v in cpu_block.items()}
    return {
        "median_s": median,
        "blocks_s": per_block,
        "cpu_median_s": cpu,
        "cpu_blocks_s": cpu_block,
        "params": params,
        "ratio": median["harness_gpt2"] / median["megatron_gpt"],
        "cpu_ratio": cpu["harness_gpt2"] / cpu["megatron_gpt"],
        "load_before": load_before,
        "load_after": load_after,
        "sizes": sizes,
        "blocks": blocks,
        "steps_per_block": steps_per_block,
        "warmup": warmup,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def profile_models(
    n_layer=4, n_embd=256, n_head=8, seq_len=128, vocab=50432, batch=8, steps=3, warmup=2, rows=12
) -> str:
    """torch.profiler over `steps` train steps of the harness GPT-2 and of Megatron's GPT (after `warmup`),
    each model's top `rows` ops by self CPU time: where the residual between the two goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    dims = (n_layer, n_embd, n_head, seq_len, vocab)
    out = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed", category=UserWarning)
        warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
        with _megatron_world():
            for name, build in builders_for(False).items():
                torch.manual_seed(0)
                model, loss_fn = build(*dims)
                step = _stepper(model, loss_fn, x, y)
                step(warmup)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    step(steps)
                total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3 / steps
                out.append(f"== {name}: {total:.1f} ms self CPU per step (sum over ops), {steps} steps profiled")
                out.append(
                    prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=40)
                )
    return "\n".join(out)


def report(result: dict) -> str:
    s = result["sizes"]
    vocab = f"vocab {s['vocab']}" + (" (GPT-2's 50257 padded to a multiple of 128)" if s["vocab"] == 50432 else "")
    lines = [
        (
            f"GPT-2 {s['n_layer']} layers x {s['n_embd']} wide, {s['n_head']} heads, T={s['seq_len']}, {vocab}, "
            f"batch {s['batch']}, fp32, {result['threads']} thread(s), torch {result['torch']}; "
            f"median of {result['blocks']} interleaved blocks x {result['steps_per_block']} steps "
            f"(train step = forward + loss + backward + AdamW), {result['warmup']} warm-up steps excluded"
        ),
        f"load average before: {result['load_before']}   after: {result['load_after']}",
    ]
    for name, med in result["median_s"].items():
        blocks = " ".join(f"{v:.3f}" for v in result["blocks_s"][name])
        lines.append(
            f"{name:14s} {med:.3f} s/step  (process CPU {result['cpu_median_s'][name]:.3f} s/step; "
            f"{result['params'][name]:,} params; blocks: {blocks})"
        )
    lines.append(
        f"process CPU time ratio, harness/megatron: {result['cpu_ratio']:.3f}  (less sensitive to other "
        "processes on the machine than wall time)"
    )
    lines.append(f"{RATIO_LINE} = {result['ratio']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ptbench.studies.model_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=50432)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="train steps per block")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-hf", action="store_true", help="leave out Hugging Face's GPT2LMHeadModel")
    p.add_argument("--profile", action="store_true", help="instead: torch.profiler's top ops (self CPU) per model")
    a = p.parse_args(argv)
    if a.profile:
        print(profile_models(a.n_layer, a.n_embd, a.n_head, a.seq_len, a.vocab, a.batch, a.steps, a.warmup), flush=True)
        return 0
    result = compare_models(
        a.n_layer,
        a.n_embd,
        a.n_head,
        a.seq_len,
        a.vocab,
        a.batch,
        a.blocks,
        a.steps,
        a.warmup,
        hf=False if a.no_hf else None,
    )
    print(report(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
