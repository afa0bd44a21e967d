"""Which attention kernel each adapter runs, and what the memory model charges for it and for the loss on CUDA.

Megatron's local layer spec gets torch's scaled_dot_product_attention as its core attention (as the harness
GPT-2 of every other adapter): it must compute what Megatron's unfused DotProductAttention computes. The memory
model counts the [b, a, s, s] scores only where the recorded kernel keeps them, and charges the CUDA loss path
(F.cross_entropy(logits.float())) the 12 s b V bytes its backward holds; both are measured here on the CPU.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from ptbench.core import memory_model as mm
from ptbench.core.memory import SavedTensorLedger, StepPeak
from tests.helpers import bench, check_ok, only_run, summary

# --- Megatron: the SDPA core attention equals the unfused one -----------------------------------------------


def _megatron_rank(rank: int, port: int, out: str) -> None:
    """One gloo rank: a Megatron GPTModel with the adapter's SDPA core attention and one with megatron-core's
    own local spec (unfused), the same weights, fp32 on the CPU; their losses and gradients to `out`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ptbench.adapters import _megatron_cpu
    from ptbench.adapters.megatron import gelu_tanh, with_sdpa_core_attention

    dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    _megatron_cpu.enable(announce=False)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=256,
        hidden_dropout=0.0,
        attention_dropout=0.5,  # on in training: compared in eval mode, and seen to act in training
        use_cpu_initialization=True,
        activation_func=gelu_tanh,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
    )
    vocab, s, b = 256, 32, 3

    def build(spec):
        torch.manual_seed(0)
        with _megatron_cpu.cuda_to_cpu():
            return GPTModel(
                config, spec, vocab_size=vocab, max_sequence_length=s, position_embedding_type="learned_absolute"
            )

    sdpa, unfused = build(with_sdpa_core_attention(get_gpt_layer_local_spec())), build(get_gpt_layer_local_spec())
    unfused.load_state_dict(sdpa.state_dict())
    x = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(s).expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]  # as the adapter passes it on a CPU
    result = {}
    for name, model in (("sdpa", sdpa), ("unfused", unfused)):
        model.eval()
        with _megatron_cpu.cuda_to_cpu():
            loss = model(x, pos, mask, labels=x).mean()
        loss.backward()
        result[name] = {
            "core": type(model.decoder.layers[0].self_attention.core_attention).__name__,
            "loss": loss.detach(),
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
        }
    sdpa.train()
    with torch.no_grad(), _megatron_cpu.cuda_to_cpu():
        result["sdpa_train_loss"] = sdpa(x, pos, mask, labels=x).mean()
    # Megatron's vocab-parallel loss on bf16 logits [s, b, V]: what its forward and backward hold at most
    logits = torch.randn(s, b, vocab, dtype=torch.bfloat16, requires_grad=True)
    with StepPeak() as p:
        tensor_parallel.vocab_parallel_cross_entropy(logits, x.t().contiguous()).mean().backward()
    result["loss_peak"] = (p.peak, s * b, vocab)
    torch.save(result, out)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_megatron_sdpa_core_attention_equals_the_unfused_one(tmp_path):
    pytest.importorskip("megatron.core")
    import torch.multiprocessing as mp

    from ptbench.core.dist import free_port

    out = str(tmp_path / "result.pt")
    mp.spawn(_megatron_rank, args=(free_port(), out), nprocs=1)
    r = torch.load(out)
    sdpa, unfused = r["sdpa"], r["unfused"]
    assert (sdpa["core"], unfused["core"]) == ("SDPACoreAttention", "DotProductAttention")
    torch.testing.assert_close(sdpa["loss"], unfused["loss"], rtol=1e-5, atol=1e-5)
    assert sdpa["grads"].keys() == unfused["grads"].keys() and len(sdpa["grads"]) > 10
    for k, g in sdpa["grads"].items():
        torch.testing.assert_close(g, unfused["grads"][k], rtol=1e-4, atol=1e-6, msg=k)
    # attention dropout acts in training (dropout_p reaches SDPA): p = 0.5 moves the loss
    assert abs(float(r["sdpa_train_loss"]) - float(sdpa["loss"])) > 1e-3
    # the memory model's in-place loss (Megatron's): the fp32 softmax it saves + the bf16 gradient, 6 N V
    peak, n, v = r["loss_peak"]
    predicted = mm.loss_bytes(n, v, True, 2)[0]
    assert predicted == 6 * n * v and predicted <= peak <= predicted * 1.02


TINY = ["workload=gpt2_tiny", "workload.seq_len=32", "workload.vocab_size=512", "data.train_samples=64"]


def test_real_runs_record_the_attention_they_ran(tmp_path, smoke_run):
    """A Megatron run and a DDP run (the shared smoke run) on CPU: both record torch's SDPA."""
    pytest.importorskip("megatron.core")
    check_ok(
        bench(
            *TINY,
            "adapter=megatron",
            "launcher.nprocs=1",
            "trainer.max_steps=2",
            "trainer.batch_size=2",
            results=tmp_path,
        )
    )
    meg, ddp = summary(only_run(tmp_path)), summary(smoke_run)
    assert (meg["adapter"], ddp["adapter"]) == ("megatron", "ddp")
    assert meg["plan"]["cost"]["attention"] == ddp["plan"]["cost"]["attention"] == "sdpa"
    assert meg["adapter_settings"]["core_attention"] == "SDPACoreAttention"


# --- the memory model: which kernels keep the scores, measured on the CPU -------------------------------------


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_sdpa_keeps_the_scores_on_a_cpu_only_with_dropout(dropout):
    """torch's SDPA on the CPU: the flash kernel (no dropout) saves q, k, v, the output and a log-sum-exp; with
    dropout the math form saves s x s tensors (softmax, mask, dropped scores). attention_keeps_scores says so."""
    b, a, s, hn = 2, 4, 128, 16
    q, k, v = (torch.randn(b, a, s, hn, requires_grad=True) for _ in range(3))
    with torch.enable_grad(), SavedTensorLedger([]) as ledger:
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
    scores = 4 * a * s * s * b  # one fp32 [b, a, s, s] tensor
    kept = ledger.total >= 3 * scores
    assert kept == mm.attention_keeps_scores("sdpa", "cpu", dropout)
    assert kept or ledger.total < scores
    assert not mm.attention_keeps_scores("sdpa", "cuda", dropout)  # flash / memory-efficient take dropout
    assert not mm.attention_keeps_scores("te", "cuda", dropout) and mm.attention_keeps_scores("unfused", "cuda", 0.0)


def _plan(adapter: str, *overrides: str):
    from ptbench.runner.compose import compose, typed
    from ptbench.runner.plan import make_plan
    from ptbench.workloads import build_workload

    cfg = typed(compose([f"adapter={adapter}", "launcher.nprocs=1", "trainer.batch_size=8", *overrides]))
    return cfg, make_plan(cfg, "local", world_size=1, check=False), build_workload(cfg.workload, cfg.data).build_model


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_megatron_scores_follow_its_attention(dropout):
    """predict_run counts Megatron's scores iff its recorded kernel keeps them: SDPA on CUDA never, on a CPU with
    dropout only; an unfused kernel always, 5 a s^2 b bytes per layer (2 without dropout) at 2-byte activations."""
    cfg, plan, build = _plan("megatron", "workload=gpt2_tiny", f"workload.dropout={dropout}", "trainer.precision=bf16")
    w = cfg.workload
    assert plan.cost.attention == "sdpa"  # no Transformer Engine here
    for device in ("cuda", "cpu"):
        pred = mm.predict_run(cfg, plan, build, device=device)
        assert pred["inputs"]["attention_scores"] is (device == "cpu" and dropout > 0)
    sdpa = mm.predict_run(cfg, plan, build, device="cuda")
    unfused = dataclasses.replace(plan, cost=dataclasses.replace(plan.cost, attention="unfused"))
    kept = mm.predict_run(cfg, unfused, build, device="cuda")
    scores = (5 if dropout else 2) * w.n_head * w.seq_len**2 * 8 * w.n_layer
    assert kept["activations"] - sdpa["activations"] == pytest.approx(scores)


# --- the loss: 12 s b V on CUDA, measured on the CPU ---------------------------------------------------------


def _loss_peak(loss_fn, dtype) -> tuple[int, int]:
    """(N x V, the bytes a loss's forward and backward hold at most beyond the logits) of [N, V] logits."""
    n, v = 512, 1024
    logits = torch.randn(n, v, dtype=dtype, requires_grad=True)
    target = torch.randint(0, v, (n,))
    with StepPeak() as p:
        loss_fn(logits, target).backward()
    return n * v, p.peak


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_cuda_loss_path_holds_12_bytes_per_logit(precision):
    """F.cross_entropy(logits.float()) (Workload.loss, what GPT-2 runs off the CPU) holds its saved fp32
    log-softmax, nll's gradient and log_softmax's gradient at once: 12 N V. The memory model charges that on
    CUDA, and the chunked CPU loss (4 N V, + 2 for the cast gradient under bf16) on the CPU; both measured."""
    from ptbench.workloads import build_workload
    from ptbench.workloads.base import Workload

    cfg, _, _ = _plan("ddp", "workload=gpt2_tiny")
    workload = build_workload(cfg.workload, cfg.data)
    dtype, act_b = (torch.bfloat16, 2) if precision == "bf16" else (torch.float32, 4)
    nv, cuda_path = _loss_peak(lambda z, t: Workload.loss(workload, z, t), dtype)
    _, cpu_path = _loss_peak(workload.loss, dtype)  # GPT2Workload.loss: the chunked loss on a CPU
    # predict's harness GPT-2 branch with nothing but the loss: 512 tokens (one sequence) x V = 1024
    only_loss = dict(layers=1, hidden=8, heads=1, seq_len=512, vocab=1024, micro_batch=1, precision=precision)
    only_loss["layer_saved_elements"] = {"layer": 0, "embed": 0, "head": 0}
    cuda, cpu = (mm.predict("none", params=1, world_size=1, device=d, **only_loss) for d in ("cuda", "cpu"))
    predicted_cuda, predicted_cpu = cuda["activations"], cpu["activations"]
    assert (predicted_cuda, cuda["saved_activations"]) == (12 * nv, 4 * nv)
    assert predicted_cpu == (6 if act_b == 2 else 4) * nv
    assert mm.loss_bytes_per_token_vocab("cuda", precision) * nv == predicted_cuda  # the GPU check's figure
    assert predicted_cuda <= cuda_path <= predicted_cuda * 1.02
    assert predicted_cpu <= cpu_path <= predicted_cpu * 1.02


def test_gpt2_small_at_batch_8_on_cuda_is_charged_12_bytes_per_logit_megatron_6():
    """predict_run for DDP gpt2_small, batch 8, bf16: the loss adds 12 s b V on CUDA, 6 s b V on the CPU, 4 of
    them saved on both. The layers' saves differ: CUDA's autocast keeps LayerNorm in fp32 and a bf16 copy of each
    weight, counted on fake CUDA tensors (tests/test_memory_model_package.py); the CPU's are halved fp32 counts."""
    cfg, plan, build = _plan("ddp", "workload=gpt2_small", "workload.dropout=0", "trainer.precision=bf16")
    n, v = 8 * 1024, 50257
    cuda, cpu = (mm.predict_run(cfg, plan, build, device=d) for d in ("cuda", "cpu"))
    beyond_saved = {d: p["activations"] - p["saved_activations"] for d, p in (("cuda", cuda), ("cpu", cpu))}
    assert beyond_saved["cuda"] == pytest.approx((12 - 4) * n * v)
    assert beyond_saved["cpu"] == pytest.approx((6 - 4) * n * v)
    assert cuda["saved_activations"] > cpu["saved_activations"]
    without_loss = cuda["activations"] - 12 * n * v
    assert without_loss == pytest.approx(cuda["saved_activations"] - 4 * n * v)
    # Megatron (vocabulary padded to 50304): its in-place loss, 6 s b V on CUDA under bf16
    cfg, plan, build = _plan("megatron", "workload=gpt2_small", "trainer.precision=bf16")
    meg = mm.predict_run(cfg, plan, build, device="cuda")
    assert meg["activations"] - meg["saved_activations"] == pytest.approx((6 - 4) * n * 50304)
