"""Explaining the numbers: predicted memory, the report's "Which adapter" section, standard sinks.

Memory: the ZeRO paper's own numbers (Fig. 1: Ψ = 7.5 B, N = 64, mixed-precision Adam), DeepSpeed's
fp32 master copy, the per-tensor partition rule, the GPT-2 shard sizes checked against the real
model's parameters, Korthikanti et al.'s activation formula, and `python -m ptbench --plan`.
Which adapter: hand-built record folders (as tests/test_analysis.py builds them) whose winners are
written out below. Sinks: the MLLOG file parsed back (through mlperf-logging's MLLogger when it is
installed, and by hand without it); TensorBoard scalars read back (skipped only without tensorboard).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from ptbench.core import memory_model as mm
from ptbench.core import sinks

REPO = Path(__file__).resolve().parents[1]
GB = 1e9
MIB = 2**20


# --- predicted memory ------------------------------------------------------------------------------
def _states(sharding, psi, n, **kw):
    return mm.predict(sharding, params=psi, world_size=n, **kw)


def test_zero_paper_figure_1_numbers():
    """ZeRO paper Fig. 1: Ψ = 7.5 B, N_d = 64, mixed-precision Adam (K = 12 with the fp32 master):
    baseline 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB per device."""
    psi, n = 7_500_000_000, 64
    ddp = _states("none", psi, n, precision="bf16")  # autocast: fp32 states = the paper's 16Ψ
    assert ddp["model_states"] / GB == pytest.approx(120.0)
    z1 = _states("zero1", psi, n, precision="bf16")
    # at the optimizer step ZeRO-1 (DeepSpeed 0.19) holds its gradient partition; during backward the
    # full gradients: the paper's 2Ψ + 2Ψ + 12Ψ/N is the peak
    assert (z1["model_states"] + z1["transient"]) / GB == pytest.approx(31.40625)
    assert z1["params"] == 2 * psi and z1["optimizer"] + z1["master"] == pytest.approx(12 * psi / n)
    z2 = _states("zero2", psi, n, precision="bf16")
    assert z2["model_states"] / GB == pytest.approx(2 * 7.5 + 14 * 7.5 / 64)  # 16.64
    assert round(z2["model_states"] / GB, 1) == 16.6
    z3 = _states("zero3", psi, n, precision="bf16")
    assert round(z3["model_states"] / GB, 1) == 1.9
    assert z3["model_states"] == pytest.approx(16 * psi / n)


def test_fp32_master_copy_optimizers_and_sharded_adapters():
    psi, n = 1_000_000, 4
    # DeepSpeed keeps an fp32 partition of the parameters for stages >= 1 even in fp32
    z2 = _states("zero2", psi, n)
    assert (z2["params"], z2["grads"], z2["optimizer"], z2["master"]) == (4 * psi, psi, 2 * psi, psi)
    z0 = _states("zero0", psi, n)
    assert z0["master"] == 0 and z0["model_states"] == 16 * psi
    fsdp = _states("fsdp", psi, n)  # no master copy
    assert fsdp["model_states"] == 16 * psi / n and fsdp["master"] == 0
    assert mm.optimizer_state_bytes("adamw") == mm.optimizer_state_bytes("lamb") == 8
    assert mm.optimizer_state_bytes("sgd") == mm.optimizer_state_bytes("lars") == 4
    assert mm.optimizer_state_bytes("sgd", momentum=0.0) == 0
    assert _states("none", psi, 2, optimizer="sgd")["model_states"] == 12 * psi
    # Megatron's distributed optimizer shards the moments over DP on CUDA; the CPU torch optimizer does not
    cuda = mm.predict("distributed_optimizer", params=psi, world_size=4, tp=2, device="cuda", replicated_params=0)
    cpu = mm.predict("distributed_optimizer", params=psi, world_size=4, tp=2, device="cpu", replicated_params=0)
    assert cuda["optimizer"] == pytest.approx(8 * psi / 2 / 2) and cpu["optimizer"] == pytest.approx(8 * psi / 2)
    # horovod: DDP's states plus a fusion buffer of up to the threshold
    hv = _states("none", psi, 2, fusion_buffer_bytes=64 * MIB)
    assert hv["model_states"] == 16 * psi and hv["transient"] == 4 * psi
    with pytest.raises(ValueError, match="unknown sharding"):
        _states("ddp", psi, 2)  # an adapter's name: the model reads the sharding its cost inputs state
    with pytest.raises(ValueError, match="dp\\*tp\\*pp"):
        mm.predict("none", params=psi, world_size=4, dp=3, tp=2)
    # GPipe: one process driving 2 devices, one replica; per device
    gp = mm.predict("none", params=psi, world_size=1, pp=2, devices_per_process=2)
    assert gp["dp"] == 1 and gp["params_per_rank"] == psi / 2


def test_deepspeed_step_holds_an_fp32_gradient_partition_after_backward():
    """DeepSpeed 1-3's step() makes an fp32 copy of the rank's gradient partition (4Ψ/N) that lives through
    the Adam step, after backward freed the activations: total = states + max(transient + activations, step).
    The step also holds the optimizer's own temporaries (CUDA foreach: 4 x the group; CPU single-tensor 8 x it)
    and before them the gradient norm's fp64 copy of the largest gradient piece (without shapes: the partition)."""
    psi, n = 1_000_000, 4
    kw = dict(precision="bf16", optimizer="adam", kind="vision")
    states = 2 * psi + 2 * psi / n + 12 * psi / n  # bf16 params + bf16 gradient partition + master and moments
    # step-dominated: activations 2 B x 100,000 elements (0.2 MB) < the step's 4Ψ/N + foreach 4Ψ/N (2 MB)
    small = _states("zero2", psi, n, activation_elements_per_sample=100_000, micro_batch=1, **kw)
    assert small["model_states"] == states and small["step_transient"] == 8 * psi / n
    assert small["step_optimizer"] in (0, 4 * psi / n)  # the fp64 norm (8 x the partition) ties with it
    assert small["activations"] == 2 * 100_000 and small["transient"] == 0
    assert small["total"] == states + 8 * psi / n  # not states + activations + step
    # activation-dominated: 2 B x 3,000,000 elements (6 MB) > 2 MB: the step hides under backward's peak
    big = _states("zero2", psi, n, activation_elements_per_sample=3_000_000, micro_batch=1, **kw)
    assert big["step_transient"] == 8 * psi / n and big["total"] == states + 6 * psi
    # the step is counted in neither PARTS nor model_states, and it reaches the record
    assert mm.record_fields(small)["step_transient"] == 2 * psi and "step_transient" not in mm.PARTS
    # offload_optimizer: the fp32 gradient partition is the persistent host buffer (nothing on the device)
    off = _states("zero2", psi, n, activation_elements_per_sample=100_000, micro_batch=1, offload_optimizer=True, **kw)
    assert off["step_transient"] == 0 and off["total"] == off["model_states"] + off["activations"]
    # CPU: torch's single-tensor Adam holds 8 x the flat partition (sqrt and quotient) beside the fp32 gradient
    assert _states("zero2", psi, 2, device="cpu")["step_transient"] == 12 * psi / 2
    assert _states("zero2", psi, 2, device="cpu", weight_decay=0.1)["step_transient"] == 12 * psi / 2  # AdamW
    assert _states("zero2", psi, 2, device="cpu", optimizer="adam", weight_decay=0.1)["step_transient"] == 16 * psi / 2
    # ... and then all-gathers the updated parameters through gloo's flat buffer of the whole group (4Ψ > 12Ψ/4)
    assert _states("zero2", psi, 4, device="cpu")["step_transient"] == 4 * psi
    # fp32 training, stage 1 and 3 alike (CUDA: 4Ψ/N gradient + 4Ψ/N foreach)
    assert _states("zero2", psi, n)["step_transient"] == 8 * psi / n
    assert _states("zero1", psi, n, precision="bf16")["step_transient"] == 8 * psi / n
    assert _states("zero3", psi, n, precision="bf16")["step_transient"] == 8 * psi / n
    assert _states("zero3", 8 * 10**9, 2, precision="bf16")["step_transient"] == 8 * mm.ZERO3_SUB_GROUP_SIZE
    # a fused optimizer (none by default): the gradient partition alone, or the bf16 copy during its conversion
    fused = _states("zero2", psi, n, precision="bf16", optimizer_impl="fused")
    assert fused["step_optimizer"] == 0 and fused["step_transient"] == 8 * psi / n  # the fp64 norm copy
    # non-DeepSpeed states: only the optimizer's temporaries (CUDA foreach: 4 x the group, here all of it)
    assert _states("none", psi, n, precision="bf16")["step_transient"] == 4 * psi
    assert _states("fsdp", psi, n, precision="bf16")["step_transient"] == 4 * psi / n
    assert _states("distributed_optimizer", psi, n, optimizer_impl="fused")["step_transient"] == 0
    assert _states("none", psi, n, device="cpu")["step_transient"] == 0  # single-tensor: needs the shapes
    with pytest.raises(ValueError, match="optimizer_impl must be one of"):
        _states("none", psi, n, optimizer_impl="apex")


def test_per_tensor_partition_keeps_straddling_gradients_whole():
    # one big tensor (90 %) and a small one: at N = 2 the big tensor straddles the middle of the flat
    # buffer, so both ranks keep its whole gradient (bench/studies/memory_points.py's expected_state)
    shapes = [(900, 10), (100, 10)]
    psi = 10_000
    flat = _states("zero2", psi, 2)
    exact = _states("zero2", psi, 2, shapes=shapes)
    assert flat["grads"] == 4 * psi / 2
    # rank 1 (elements 5000-9999) touches both tensors: it keeps both gradients whole
    assert exact["grads"] == 4 * 10_000 and exact["optimizer"] + exact["master"] == 12 * 5000
    # FSDP2 splits every tensor by rows: rank 0 holds 450 + 50 rows
    fsdp = _states("fsdp", psi, 2, shapes=shapes)
    assert fsdp["params"] == 4 * (450 * 10 + 50 * 10)
    # ZeRO-3 splits each tensor into ceil(numel / N)
    z3 = _states("zero3", psi, 3, shapes=[(10,), (1,)])
    assert z3["params"] == 4 * (4 + 1)


def _gpt2_model(**over):
    import torch

    from ptbench.runner.compose import compose, typed
    from ptbench.workloads import build_workload

    cfg = typed(compose(["workload=gpt2_tiny", *[f"workload.{k}={v}" for k, v in over.items()]]))
    with torch.device("meta"):
        return cfg, build_workload(cfg.workload, cfg.data).build_model()


def test_gpt2_shards_match_the_real_model():
    cfg, model = _gpt2_model(n_layer=4)
    w = cfg.workload
    named = dict(model.named_parameters())
    psi = sum(p.numel() for p in named.values())
    # tensor parallel keeps these whole on every rank (adapters/tensor_parallel.py's plan)
    whole = sum(
        p.numel()
        for n, p in named.items()
        if n.startswith("wpe") or ".ln_" in n or n.startswith("ln_f") or n.endswith("c_proj.bias")
    )
    assert mm.gpt2_replicated_under_tp(w.n_layer, w.n_embd, w.seq_len) == whole
    # pipeline over 2 stages: first = embeddings + 2 blocks, last = 2 blocks + ln_f + a copy of the head
    block = sum(p.numel() for p in model.blocks[0].parameters())
    first, last = mm.gpt2_stage_params(
        psi, layers=w.n_layer, hidden=w.n_embd, seq_len=w.seq_len, vocab=w.vocab_size, pp=2
    )
    emb = model.wte.weight.numel() + model.wpe.weight.numel()
    assert first == emb + 2 * block
    assert last == 2 * block + sum(p.numel() for p in model.ln_f.parameters()) + model.wte.weight.numel()
    tp = mm.predict(
        "none", params=psi, world_size=2, tp=2, layers=w.n_layer, hidden=w.n_embd, heads=w.n_head, seq_len=w.seq_len
    )
    assert tp["params_per_rank"] == pytest.approx((psi - whole) / 2 + whole)


def test_korthikanti_activation_formula():
    s, b, h, a, L, V = 1024, 2, 1024, 16, 24, 50257
    kw = dict(params=350_000_000, world_size=1, layers=L, hidden=h, heads=a, seq_len=s, vocab=V, micro_batch=b)
    bf16 = mm.predict("none", precision="bf16", **kw)
    per_layer = s * b * h * (34 + 5 * a * s / h)
    assert bf16["activations"] == pytest.approx(L * per_layer + 12 * s * b * V)
    fp32 = mm.predict("none", precision="fp32", **kw)
    assert fp32["activations"] == pytest.approx(2 * L * per_layer + 12 * s * b * V)
    fused = mm.predict("none", precision="bf16", attention_scores=False, **kw)
    assert fused["activations"] == pytest.approx(L * s * b * h * 34 + 12 * s * b * V)
    # tensor parallel t without sequence parallelism: sbh(10 + 24/t + 5as/(ht)); logits split by vocab, under
    # torch's loss_parallel (not in place) 16 s b V / t at its backward (loss_bytes)
    t = 4
    tp = mm.predict("none", precision="bf16", tp=t, **{**kw, "world_size": 4}, replicated_params=0)
    assert tp["activations"] == pytest.approx(L * s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) + 16 * s * b * V / t)
    sp = mm.predict(
        "none", precision="bf16", tp=t, sequence_parallel=True, **{**kw, "world_size": 4}, replicated_params=0
    )
    assert sp["activations"] == pytest.approx(L * per_layer / t + 16 * s * b * V / t)
    # 1F1B over 4 stages, 8 micro-batches: the first stage keeps 4 micro-batches of 6 layers (= L layers)
    pipe = mm.predict("none", precision="bf16", pp=4, microbatches=8, **{**kw, "world_size": 4})
    first_acts = 4 * 6 * per_layer
    assert pipe["busiest"] in ("first", "last")
    if pipe["busiest"] == "first":
        assert pipe["activations"] == pytest.approx(first_acts)
    gp = mm.predict("none", precision="bf16", pp=4, microbatches=8, schedule="gpipe", **{**kw, "world_size": 4})
    assert gp["activations"] >= 8 * 6 * per_layer  # GPipe keeps every micro-batch


def test_vision_activation_count_and_fits():
    import torch
    from torch import nn

    with torch.device("meta"):
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(4 * 8 * 8, 10)
        )
    # what autograd saves, each storage once: the conv its input (3 x 8 x 8), the in-place ReLU its output
    # (4 x 8 x 8), shared by the Flatten view and the linear's saved input
    assert mm.activation_elements(model, (3, 8, 8)) == 3 * 8 * 8 + 4 * 8 * 8
    p = mm.predict(
        "none",
        params=1000,
        world_size=1,
        kind="vision",
        micro_batch=16,
        activation_elements_per_sample=266,
        precision="bf16",
    )
    assert p["activations"] == 266 * 2 * 16
    assert mm.fits(80, 100) and not mm.fits(95, 100) and mm.fits(95, 100, headroom=1.0) and mm.fits(1e30, None)
    from ptbench.core.errors import ConfigError

    with pytest.raises(ConfigError, match="exceeds 90% of the device"):
        mm.check_fits(p, device=p["total"] / 2)


def test_predict_run_from_a_config_counts_the_model():
    from ptbench.runner.compose import compose, typed
    from ptbench.runner.plan import make_plan
    from ptbench.workloads import build_workload

    cfg = typed(
        compose(["adapter=zero", "adapter.stage=2", "launcher.nprocs=2", "workload=gpt2_tiny", "trainer.batch_size=4"])
    )
    plan = make_plan(cfg, "local", check=False)
    build = build_workload(cfg.workload, cfg.data).build_model
    pred = mm.predict_run(cfg, plan, build, device="cpu")
    model = build()
    psi = sum(p.numel() for p in model.parameters())
    assert pred["inputs"]["params"] == psi and pred["dp"] == 2 and pred["sharding"] == "zero2"
    assert pred["inputs"]["micro_batch"] == 4 and pred["inputs"]["attention_scores"] is False
    # gpt2_tiny's token embedding (94 % of Ψ) straddles the two partitions: both ranks keep its gradient
    assert pred["grads"] > 4 * psi / 2
    # the step on the CPU: the larger group's (tensors of >= 2 dimensions) fp32 gradient partition + single-tensor
    # AdamW's sqrt and quotient on it (12 B per element); gpt2_tiny's other group holds only biases and norms
    g0 = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    assert pred["step_transient"] == 12 * math.ceil(g0 / 2) and pred["step_optimizer"] == 8 * math.ceil(g0 / 2)
    assert pred["total"] == pytest.approx(
        pred["model_states"] + max(pred["transient"] + pred["activations"], pred["step_transient"])
    )


def test_plan_flag_prints_the_prediction_and_starts_no_rank(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ptbench",
            "--plan",
            "adapter=fsdp",
            "launcher.nprocs=2",
            "workload=gpt2_tiny",
            f"results.root={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "predicted memory per rank: fsdp, 2 rank(s)" in out.stdout
    for part in ("params", "grads", "optimizer", "activations", "total"):
        assert f"  {part}" in out.stdout
    assert "device memory:" in out.stdout
    assert not any(tmp_path.iterdir())  # no run folder: nothing launched
    bad = subprocess.run(
        [sys.executable, "-m", "ptbench", "--plan", "adapter=ddp", "trainer.nosuch=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "error:" in bad.stderr


# --- which adapter ----------------------------------------------------------------------------------
def _ev(epoch, time, steps, gb, devices, wall, metric, delta_mib, states_mib, kind="language"):
    ev = {
        "type": "epoch",
        "epoch": epoch,
        "steps": steps,
        "global_batch": gb,
        "devices": devices,
        "epoch_time_s": time,
        "step_time_mean_s": time / steps,
        "samples_per_s": gb * steps / time,
        "partial": False,
        "wall_time_s": wall,
        "val_time_s": 0.5,
        "memory_metric": "peak_rss",
        "train_loss": 3.0 - 0.1 * epoch,
        "train_losses": [3.0 - 0.1 * epoch - 0.01 * i for i in range(steps)],
        "ranks": [
            {
                "rank": 0,
                "memory": {"peak_rss": 2000 * MIB, "peak_rss_delta": delta_mib * MIB},
                "state_bytes": {
                    "params": states_mib * MIB / 4,
                    "grads": states_mib * MIB / 4,
                    "optimizer": states_mib * MIB / 2,
                },
            }
        ],
    }
    if metric is not None:
        if kind == "vision":
            ev["val_accuracy"] = metric
        else:
            ev["val_perplexity"], ev["val_loss"] = metric, math.log(metric)
    ev["peak_memory_max"] = 2000 * MIB
    return ev


def _run(
    root,
    name,
    adapter,
    devices,
    times,
    ppl,
    walls,
    delta,
    states,
    settings=None,
    status="ok",
    kind="language",
    steps=None,
    gb=None,
):
    d = Path(root) / name
    d.mkdir(parents=True)
    gb = gb or 8 * devices
    steps = steps or 96 // gb
    cfg = {
        "workload": {"name": "wl", "kind": kind},
        "adapter": {"name": adapter, "batch_policy": "per_device", **(settings or {})},
        "launcher": {"name": "local", "nprocs": devices},
        "trainer": {"batch_size": 8, "grad_accum": 1, "precision": "fp32", "seed": 1},
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "data": {"source": "synthetic", "val_samples": 32},
        "results": {"experiment": "hand"},
    }
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    events = [
        _ev(i, t, steps, gb, devices, w, m, delta, states, kind) for i, (t, m, w) in enumerate(zip(times, ppl, walls))
    ]
    summary = {
        "status": status,
        "run_id": name,
        "adapter": adapter,
        "workload": "wl",
        "experiment": "hand",
        "world_size": devices,
        "devices": devices,
        "global_batch": gb,
        "total_time_s": walls[-1] + 1 if walls else 1,
    }
    if status == "ok" and len(times) > 1:
        summary["epoch_time_steady_s"] = float(np.mean(times[1:]))
    if status != "ok":
        summary["error"] = "CUDA out of memory"
    (d / "summary.json").write_text(json.dumps(summary))
    if events:
        (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return d


def _sweep(root):
    # ddp x1: steady 4.0 s per 96 samples; best perplexity 20 (epoch 3, 30 s); 400 MiB over the process
    _run(root, "ddp1", "ddp", 1, [12.0, 4.0, 4.0], [50.0, 30.0, 20.0], [10.0, 20.0, 30.0], 400, 100)
    # ddp x2: steady 2.5 s (efficiency (4/2.5)/2 = 0.8); best 22, reached at epoch 3 (18 s); 420 MiB
    _run(root, "ddp2", "ddp", 2, [7.5, 2.5, 2.5], [45.0, 28.0, 22.0], [6.0, 12.0, 18.0], 420, 100)
    # zero3 x2: steady 3.0 s (efficiency 0.667); reaches 21.5 <= 22 already at epoch 2 (16 s); 200 MiB
    _run(
        root, "z3x2", "zero", 2, [9.0, 3.0, 3.0], [48.0, 21.5, 21.0], [8.0, 16.0, 24.0], 200, 30, settings={"stage": 3}
    )
    # an fsdp point that ran out of memory: listed as not decided, never a winner
    _run(root, "fsdp4", "fsdp", 4, [], [], [], 0, 0, status="oom")


def test_which_adapter_names_the_winners_and_their_runs(tmp_path):
    from ptbench.analysis import load
    from ptbench.analysis.report import time_to_target, which_adapter, write_report

    root = tmp_path / "r"
    _sweep(root)
    df = load(root)
    t = time_to_target(df, target=22.0).set_index("run_id")
    # target 22 (given): each run's crossing interpolated between epoch ends; ddp x1 30 -> 20 (20 s -> 30 s)
    assert set(t["target"]) == {22.0}
    assert t.loc["ddp1", "time_s"] == pytest.approx(28.0) and t.loc["ddp2", "time_s"] == 18.0
    assert t.loc["z3x2", "time_s"] == pytest.approx(8 + 8 * 26 / 26.5) and t.loc["z3x2", "epoch"] == pytest.approx(
        1.98, abs=0.01
    )
    v = which_adapter(df, target=22.0)["wl"]
    assert v["fastest"]["run_id"] == "z3x2" and v["fastest"]["label"] == "zero stage=3 gb=8/replica"
    assert v["fastest"]["time_s"] == pytest.approx(15.85, abs=0.01)
    mem = {m["devices"]: m for m in v["memory"]}
    assert mem[1]["label"] == "ddp gb=8/replica" and mem[1]["runs"] == ["ddp1"] and mem[1]["mib"] == pytest.approx(400)
    assert mem[2]["label"] == "zero stage=3 gb=8/replica" and mem[2]["mib"] == pytest.approx(200)
    assert mem[2]["states_mib"] == pytest.approx(30) and mem[2]["metric"] == "peak_rss_delta"
    sc = v["scaling"]
    assert sc["devices"] == 2 and sc["label"] == "ddp gb=8/replica" and sc["runs"] == ["ddp2"]
    assert sc["efficiency"] == pytest.approx(0.8) and sc["speedup"] == pytest.approx(1.6)
    assert sc["baseline_runs"] == ["ddp1"]
    assert any("single run" in u for u in v["undecided"])
    assert any("differ in global batch (8, 16)" in u for u in v["undecided"])

    write_report(root, tmp_path / "out", target=22.0)
    report = (tmp_path / "out" / "report-details.md").read_text()  # every answer with its runs: in the details
    section = report[report.index("## Which adapter") :]
    assert report.rstrip().endswith(section.rstrip())  # the details end with it
    assert (
        "**Fastest to the target**: validation perplexity ≤ 22 (fixed from --target): **`zero stage=3 "
        "gb=8/replica` x2** after 15.85 s of wall time (geometric mean of 1 run(s), crossing at epoch 1.98; runs "
        "z3x2); not shown faster than every other point (Holm over 0 pair(s) with an interval): not distinguishable"
    ) in section
    assert (
        "**Lowest memory per rank at 2 devices** (`peak_rss_delta`, busiest rank): **`zero stage=3 gb=8/replica` x2** 200 MiB"
        in section
    )
    assert "**Best scaling efficiency at 2 devices**: **`ddp gb=8/replica` x2** efficiency 0.8 (speedup 1.6" in section
    assert "runs ddp2, baseline ddp1" in section
    undecided = next(ln for ln in section.splitlines() if ln.startswith("- **Could not decide**"))
    assert "single run" in undecided and "`fsdp gb=8/replica` x4 oom" in undecided


def test_which_adapter_says_what_it_cannot_decide(tmp_path):
    from ptbench.analysis import load
    from ptbench.analysis.report import which_adapter, which_adapter_lines

    root = tmp_path / "r"
    # vision, one device count, no validation metric; two runs of one point (spread exists there)
    _run(root, "a", "ddp", 2, [3.0, 2.0], [None, None], [3.0, 5.0], 300, 50, kind="vision")
    _run(root, "b", "ddp", 2, [3.0, 2.1], [None, None], [3.0, 5.1], 310, 50, kind="vision")
    _run(root, "c", "fsdp", 2, [3.0, 2.2], [None, None], [3.0, 5.2], 150, 20, kind="vision")
    v = which_adapter(load(root))["wl"]
    assert v["fastest"] is None and v["scaling"] is None
    text = " ".join(v["undecided"])
    assert "no finished run recorded a validation metric" in text
    assert "only 2 device(s) measured" in text
    assert "1 of 2 points are single runs" in text
    assert v["memory"][0]["label"] == "fsdp gb=8/replica" and v["memory"][0]["runs"] == ["c"]
    # vision: the target is the lowest of the runs' best accuracies; higher is better
    _run(root, "d", "zero", 2, [3.0, 2.0], [0.50, 0.70], [3.0, 5.0], 250, 40, kind="vision", settings={"stage": 1})
    _run(root, "e", "zero", 2, [3.0, 2.0], [0.65, 0.66], [2.0, 4.0], 260, 40, kind="vision", settings={"stage": 2})
    v = which_adapter(load(root), target=0.66)["wl"]
    assert v["fastest"]["target"] == pytest.approx(0.66)
    # d crosses 0.66 between 0.50 (3.0 s) and 0.70 (5.0 s), at 4.6 s; e reaches it at its epoch 2 (4.0 s): e wins
    assert v["fastest"]["run_id"] == "e" and v["fastest"]["time_s"] == 4.0
    lines = "\n".join(which_adapter_lines(load(root), target=0.66))
    assert "validation accuracy ≥ 0.66" in lines


# --- sinks ------------------------------------------------------------------------------------------
def _record(tmp_path, status="ok"):
    root = tmp_path / "rec"
    d = _run(root, "run1", "ddp", 2, [4.0, 2.0], [40.0, 25.0], [4.5, 7.0], 100, 10, status="ok")
    summary = json.loads((d / "summary.json").read_text())
    summary["status"] = status
    events = [json.loads(ln) for ln in (d / "events.jsonl").read_text().splitlines()]
    config = yaml.safe_load((d / "config.yaml").read_text())
    return d, summary, events, config


def _check_mllog(path, summary, events, t0):
    recs = sinks.read_mllog(path)
    assert all(set(r) >= {"namespace", "time_ms", "event_type", "key", "value", "metadata"} for r in recs)
    keys = [r["key"] for r in recs]
    for k in (
        "submission_benchmark",
        "global_batch_size",
        "opt_base_learning_rate",
        "run_start",
        "run_stop",
        "epoch_start",
        "epoch_stop",
        "eval_accuracy",
    ):
        assert k in keys, k
    by = {k: [r for r in recs if r["key"] == k] for k in set(keys)}
    assert by["submission_benchmark"][0]["value"] == "wl" and by["global_batch_size"][0]["value"] == 16
    assert by["opt_base_learning_rate"][0]["value"] == 1e-3
    assert by["run_start"][0]["event_type"] == "INTERVAL_START" and by["run_stop"][0]["event_type"] == "INTERVAL_END"
    assert [r["metadata"]["epoch_num"] for r in by["epoch_start"]] == [1, 2]
    assert [r["value"] for r in by["eval_accuracy"]] == [e["val_perplexity"] for e in events]
    assert all(r["metadata"]["metric"] == "perplexity" for r in by["eval_accuracy"])
    assert all(r["event_type"] == "POINT_IN_TIME" for r in by["eval_accuracy"])
    # times: epoch 2 ends at start + (wall - val) = 6.5 s and began 2.0 s before
    starts, stops = by["epoch_start"], by["epoch_stop"]
    assert stops[1]["time_ms"] == round(t0 * 1000) + 6500 and starts[1]["time_ms"] == round(t0 * 1000) + 4500
    times = [r["time_ms"] for r in recs]
    assert times == sorted(times)
    return by


def test_mllog_lines_parse_back(tmp_path):
    d, summary, events, config = _record(tmp_path)
    t0 = 1_700_000_000.0
    path = sinks.write_mllog(d, summary, events, config, start_time_s=t0)
    assert path == d / "mllog.txt"
    assert all(ln.startswith(":::MLLOG {") for ln in path.read_text().splitlines() if ln.strip())
    by = _check_mllog(path, summary, events, t0)
    assert by["run_stop"][0]["metadata"]["status"] == "success"
    # a run that did not finish: run_stop says aborted
    summary["status"] = "failed"
    by = _check_mllog(sinks.write_mllog(d, summary, events, config, start_time_s=t0), summary, events, t0)
    assert by["run_stop"][0]["metadata"]["status"] == "aborted"


def test_write_sinks_from_the_record_never_raises(tmp_path):
    d, *_ = _record(tmp_path)
    out = sinks.write_sinks(d, mllog=True, tensorboard=True)
    assert out["mllog"] == str(d / "mllog.txt")
    if sinks.tensorboard_unavailable():
        assert out["tensorboard"].startswith("skipped: tensorboard is not installed")
    assert sinks.write_sinks(tmp_path / "nothing-here")["mllog"].startswith("failed:")


def _require(module: str) -> None:
    import importlib.util

    from tests.conftest import require_or_skip

    if importlib.util.find_spec(module) is None:
        require_or_skip(f"the {module} package", 'pip install -e ".[dev]"')


def test_tensorboard_scalars_read_back(tmp_path):
    _require("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d, summary, events, config = _record(tmp_path)
    out = sinks.write_tensorboard(d, events)
    acc = EventAccumulator(str(out))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "val/perplexity", "time/epoch_s", "throughput/samples_per_s", "train/step_loss"} <= tags
    assert [s.value for s in acc.Scalars("time/epoch_s")] == pytest.approx([4.0, 2.0])
    steps = acc.Scalars("train/step_loss")
    assert [s.step for s in steps] == list(range(sum(len(e["train_losses"]) for e in events)))
    assert [s.value for s in steps] == pytest.approx([v for e in events for v in e["train_losses"]])


def test_plan_memory_is_one_call_for_the_runner():
    from ptbench.core.errors import ConfigError
    from ptbench.runner.compose import compose, typed
    from ptbench.runner.plan import make_plan
    from ptbench.workloads import build_workload

    cfg = typed(compose(["adapter=ddp", "launcher.nprocs=1", "workload=gpt2_tiny"]))
    plan = make_plan(cfg, "local", check=False)
    build = build_workload(cfg.workload, cfg.data).build_model
    rec = mm.plan_memory(cfg, plan, build)
    json.dumps(rec)  # JSON-ready for the summary
    assert (
        rec["total"] == rec["model_states"] + rec["transient"] + rec["activations"]
        or abs(rec["total"] - rec["model_states"] - rec["transient"] - rec["activations"]) <= 2
    )
    # the optimizer step (single-tensor AdamW on the CPU): 8 x the token embedding, hidden under backward's peak
    assert rec["fits"] is True and rec["sharding"] == "none" and rec["step_transient"] == 8 * 50257 * 128
    assert rec["step_transient"] < rec["transient"] + rec["activations"]
    big = typed(compose(["adapter=ddp", "launcher.nprocs=1", "workload=gpt2_medium", "trainer.batch_size=4096"]))
    with pytest.raises(ConfigError, match="predicted memory per rank"):
        mm.plan_memory(
            big, make_plan(big, "local", check=False), build_workload(big.workload, big.data).build_model, check=True
        )


# --- communication volume per step, measured network, report table -----------------------------------
def _gpt2_params(V, s, h, L):
    """GPT-2 with a tied LM head, by hand: embeddings V h + s h, per block 12 h^2 + 13 h (qkv 3h^2+3h,
    proj h^2+h, fc 4h^2+4h, fc2 4h^2+h, two LayerNorms 4h), final LayerNorm 2h."""
    return V * h + s * h + L * (12 * h * h + 13 * h) + 2 * h


def _plan_volume(*overrides):
    from ptbench.runner.compose import compose, typed
    from ptbench.runner.plan import comm_volume, make_plan

    cfg = typed(compose(["workload=gpt2_tiny", "workload.vocab_size=256", "launcher.nprocs=2", *overrides]))
    plan = make_plan(cfg, "local", check=False)
    return plan, comm_volume(cfg, plan, "gloo")


def test_comm_volume_recorded_from_the_plan_matches_hand_counts():
    psi = _gpt2_params(256, 64, 128, 2)  # gpt2_tiny: V 256, s 64, h 128, L 2
    assert psi == 437_760
    # DDP: ring all-reduce of fp32 gradients, 2 (N-1)/N x Psi x 4 bytes, in backward
    _, ddp = _plan_volume("adapter=ddp")
    json.dumps(ddp)  # JSON-ready for the summary
    assert ddp["total_bytes"] == 2 * (2 - 1) / 2 * psi * 4 == 1_751_040
    assert ddp["by_op"] == {"all_reduce": 1_751_040} and ddp["phases"] == ["backward"] and ddp["backend"] == "gloo"
    assert ddp["collectives"][0]["formula"] == "2(N-1)/N * Psi * B" and ddp["params_per_rank"] == psi
    # ZeRO-3: parameters all-gathered in forward and again in backward, gradients reduce-scattered:
    # 3 collectives of (N-1)/N x Psi x 4 bytes each
    _, z3 = _plan_volume("adapter=zero", "adapter.stage=3")
    assert [(c["op"], c["phase"], c["bytes"]) for c in z3["collectives"]] == [
        ("all_gather", "forward", psi * 4 / 2),
        ("all_gather", "backward", psi * 4 / 2),
        ("reduce_scatter", "backward", psi * 4 / 2),
    ]
    assert z3["total_bytes"] == 3 * psi * 4 / 2 and z3["phases"] == ["forward", "backward"]
    # FSDP2 under bf16 gathers 2-byte parameters and reduce-scatters fp32 gradients
    _, fsdp = _plan_volume("adapter=fsdp", "trainer.precision=bf16")
    assert fsdp["by_op"] == {"all_gather": 2 * psi * 2 / 2, "reduce_scatter": psi * 4 / 2}
    # a 2-stage pipeline: one b x s x h fp32 activation per micro-batch leaves stage 0
    plan, pipe = _plan_volume("adapter=pipeline")
    b = plan.local_batch // plan.microbatches
    assert pipe["by_op"] == {"send_recv": plan.microbatches * b * 64 * 128 * 4}
    assert pipe["phases"] == ["forward_backward"]


def _comm_json(folder, backend, n, rows):
    folder.mkdir(parents=True, exist_ok=True)
    rep = {
        "tool": "ptbench.comm",
        "backend": backend,
        "world_size": n,
        "results": [{"op": op, "bytes": size, "busbw_GBps": bw} for op, size, bw in rows],
    }
    (folder / f"{backend}-{n}.json").write_text(json.dumps(rep))


def _add_comm(d, collectives, phase_times, backend="gloo"):
    """A hand-built record gains `comm_volume` and per-phase times (the same in every epoch)."""
    s = json.loads((d / "summary.json").read_text())
    phases = []
    for c in collectives:
        phases += [p for p in c["phase"].split(",") if p not in phases]
    s["comm_volume"] = {
        "backend": backend,
        "total_bytes": float(sum(c["bytes"] for c in collectives)),
        "phases": phases,
        "collectives": collectives,
    }
    (d / "summary.json").write_text(json.dumps(s))
    evs = [json.loads(ln) for ln in (d / "events.jsonl").read_text().splitlines()]
    (d / "events.jsonl").write_text(
        "".join(json.dumps({**e, **{f"{p}_time_mean_s": t for p, t in phase_times.items()}}) + "\n" for e in evs)
    )


def _coll(op, n, message, bytes_, phase, formula="f"):
    return {
        "name": f"{op}_{phase}",
        "op": op,
        "group": "dp",
        "group_size": n,
        "message_bytes": message,
        "calls": 1,
        "bytes": bytes_,
        "formula": formula,
        "phase": phase,
        "bytes_per_elem": 4,
    }


def test_report_sets_comm_volume_against_measured_busbw(tmp_path):
    from ptbench.analysis import load
    from ptbench.analysis.load import load_comm
    from ptbench.analysis.report import comm_lines
    from ptbench.analysis.tables import comm_table

    root = tmp_path / "r"
    # ddp x2: steps of 4.0/6 and 2.0/6 s (mean 500 ms), backward 150 ms; 1 MB all-reduce per step
    d = _run(root, "ddp2", "ddp", 2, [4.0, 2.0], [40.0, 30.0], [4.5, 7.0], 100, 10)
    _add_comm(d, [_coll("all_reduce", 2, 1e6, 1e6, "backward", "2(N-1)/N * Psi * B")], {"backward": 0.15})
    # zero3 x2: 2 all-gathers of 1 MB (2 MB messages) and a 1 MB reduce-scatter; forward 100 + backward 200 ms
    d = _run(root, "z3x2", "zero", 2, [4.0, 2.0], [40.0, 30.0], [4.5, 7.0], 100, 10, settings={"stage": 3})
    _add_comm(
        d,
        [
            _coll("all_gather", 2, 2e6, 1e6, "forward"),
            _coll("all_gather", 2, 2e6, 1e6, "backward"),
            _coll("reduce_scatter", 2, 2e6, 1e6, "backward"),
        ],
        {"forward": 0.1, "backward": 0.2},
    )
    # fsdp x4: no 4-rank measurement here
    d = _run(root, "fsdp4", "fsdp", 4, [4.0, 2.0], [40.0, 30.0], [4.5, 7.0], 100, 10)
    _add_comm(d, [_coll("all_gather", 4, 4e6, 3e6, "forward")], {"forward": 0.1})
    # ddp x1: nothing to communicate; horovod x2: a record from before `comm_volume`
    _add_comm(_run(root, "ddp1", "ddp", 1, [4.0, 2.0], [40.0, 30.0], [4.5, 7.0], 100, 10), [], {})
    _run(root, "hvd2", "horovod", 2, [4.0, 2.0], [40.0, 30.0], [4.5, 7.0], 100, 10)
    _comm_json(
        root / "comm",
        "gloo",
        2,
        [
            ("all_reduce", 262144, 0.5),
            ("all_reduce", 1048576, 2.0),
            ("all_reduce", 4194304, 4.0),
            ("all_gather", 1048576, 1.0),
            ("all_gather", 4194304, 3.0),
            ("reduce_scatter", 4194304, 0.5),
        ],
    )
    reports = load_comm(root)
    assert len(reports) == 1 and reports[0]["world_size"] == 2
    t = comm_table(load(root), reports).set_index(["series", "devices"])
    ddp = t.loc[("ddp gb=8/replica", 2)]
    assert ddp["step (ms)"] == pytest.approx(500) and ddp["phase (ms)"] == pytest.approx(150)
    assert ddp["comm phase"] == "backward" and ddp["comm MB/step"] == pytest.approx(1.0)
    # nearest measured size to 1e6 B on a log scale is 1 MiB (busbw 2 GB/s): 1e6 / 2e9 s = 0.5 ms
    assert ddp["at busbw (ms)"] == pytest.approx(0.5)
    z3 = t.loc[("zero stage=3 gb=8/replica", 2)]
    assert z3["comm phase"] == "forward+backward" and z3["phase (ms)"] == pytest.approx(300)
    # all-gather: 2e6 B is nearer 1 MiB (ln 1.91 = 0.65) than 4 MiB (ln 2.10 = 0.74): 1 GB/s, 1 ms each;
    # reduce-scatter measured at 4 MiB only (the end point): 0.5 GB/s, 2 ms
    assert z3["at busbw (ms)"] == pytest.approx(1 + 1 + 2)
    assert z3["comm MB/step"] == pytest.approx(3.0)
    assert t.loc[("fsdp gb=8/replica", 4), "at busbw (ms)"] == "not measured"
    assert "no all_gather at 4 ranks on gloo" in t.loc[("fsdp gb=8/replica", 4), "busbw used"]
    one = t.loc[("ddp gb=8/replica", 1)]
    assert one["at busbw (ms)"] == 0 and one["busbw used"] == "no collectives" and one["comm MB/step"] == 0
    old = t.loc[("horovod gb=8/replica", 2)]
    assert old["at busbw (ms)"] == "not measured" and old["busbw used"] == "no volume in the record"
    assert old["comm phase"] == "-" and old["formula"] == "-"
    (tmp_path / "out").mkdir()
    section = "\n".join(comm_lines(load(root), reports, tmp_path / "out"))
    assert section.startswith("## Communication per step")
    assert "nearest to the collective's whole message (log scale" in section and "gloo x2 (gloo-2.json)" in section
    assert "| `ddp gb=8/replica` x2 | wl | 1 | 500 | backward | 150 | 1 | 0.5 |" in " ".join(section.split())
    assert (tmp_path / "out" / "comm.csv").exists()


def test_sweep_measures_the_network_once_per_world_size(tmp_path, capsys):
    from ptbench import sweep

    root = tmp_path / "res"
    points = [
        ["adapter=ddp", "launcher.nprocs=2"],
        ["adapter=zero", "launcher.nprocs=2"],
        ["adapter=ddp", "launcher.nprocs=1"],
        ["adapter=ddp", "launcher.nprocs=4"],
    ]
    extra = ["experiment=smoke", f"results.root={root}"]
    folder = root / "smoke" / "comm"
    assert sweep.comm_targets(points, extra) == [(folder, 2, "auto"), (folder, 4, "auto")]
    sweep.measure_comm(points, extra, dry_run=True)
    cmds = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("comm: ")]
    assert len(cmds) == 2 and all(f"--out {folder}" in c and "-m ptbench.comm" in c for c in cmds)
    assert "--world-size 2 --backend auto" in cmds[0] and "--world-size 4" in cmds[1]
    # on Slurm: one small job per world size, srun starting one ptbench.comm rank per task
    sweep_file = tmp_path / "sweep.txt"
    sweep.write_points(sweep_file, points, "test")
    assert sweep.submit_comm(sweep_file, extra, dry_run=True) == 0
    subs = capsys.readouterr().out.splitlines()
    assert len(subs) == 2 and all(c.startswith("sbatch --parsable --job-name=bench-comm") for c in subs)
    assert "--ntasks-per-node=2" in subs[0] and "--ntasks-per-node=4" in subs[1]
    assert f"--wrap=srun {sys.executable} -m ptbench.comm --backend auto" in subs[0] and f"--out {folder}'" in subs[0]
    _comm_json(folder, "gloo", 2, [])
    sweep.measure_comm(points, extra, dry_run=True, resume=True)
    out = capsys.readouterr().out
    assert "already holds a 2-rank measurement: kept (--resume)" in out and "--world-size 4" in out


def test_a_real_run_records_its_volume_and_the_table_reads_it(tmp_path):
    """The runner's path, real: one 2-rank ddp point through `ptbench.sweep run --no-comm` (the measurement
    itself is tests/test_comm.py's), its record's `comm_volume`, and the report table over it."""
    from helpers import check_ok, only_run, run, summary

    from ptbench.analysis import load
    from ptbench.analysis.load import load_comm
    from ptbench.analysis.tables import comm_table

    sweep_file = tmp_path / "sweep.txt"
    sweep_file.write_text("adapter=ddp launcher.nprocs=2 workload.vocab_size=256 trainer.max_steps=3\n")
    res = tmp_path / "res"
    out = run(
        [
            sys.executable,
            "-m",
            "ptbench.sweep",
            "run",
            str(sweep_file),
            "--no-comm",
            "--",
            "experiment=smoke",
            f"results.root={res}",
        ],
        timeout=600,
    )
    check_ok(out)
    assert "-m ptbench.comm" not in out.stdout
    s = summary(only_run(res))
    cv = s["comm_volume"]
    assert cv["total_bytes"] == 2 * (2 - 1) / 2 * _gpt2_params(256, 64, 128, 2) * 4 and cv["backend"] == "gloo"
    # the plan's layout (ptbench.core.layout.Layout), recorded for analysis; the cost inputs in the plan
    assert s["layout"] == {
        "world_size": 2,
        "dp": 2,
        "tp": 1,
        "pp": 1,
        "devices_per_process": 1,
        "microbatches": 1,
        "devices": 2,
    }
    assert s["plan"]["layout"] == s["layout"] and s["plan"]["cost"]["sharding"] == "none"
    _comm_json(res / "smoke" / "comm", "gloo", 2, [("all_reduce", 1 << 20, 0.25)])
    row = comm_table(load(res / "smoke"), load_comm(res / "smoke")).iloc[0]
    assert row["at busbw (ms)"] == pytest.approx(cv["total_bytes"] / 0.25e9 * 1e3)
    assert row["comm phase"] == "backward" and 0 < row["phase (ms)"] < row["step (ms)"]


def test_optional_sinks_refused_before_launch_when_missing(monkeypatch):
    from ptbench.core.errors import ConfigError
    from ptbench.runner.checks import check_config
    from ptbench.runner.compose import compose, typed

    for key in ("wandb", "mlflow"):
        monkeypatch.setitem(sys.modules, key, None)  # as if not installed: import raises ImportError
        cfg = typed(compose(["adapter=ddp", f"results.{key}=true"]))
        with pytest.raises(
            ConfigError, match=rf'results.{key}=true but {key} is not installed .*pip install -e "\.\[{key}\]"'
        ):
            check_config(cfg)
        monkeypatch.delitem(sys.modules, key)
    check_config(typed(compose(["adapter=ddp"])))  # off by default: nothing to import


def test_mlflow_run_reads_back(tmp_path, monkeypatch):
    _require("mlflow")  # in the dev extra: missing fails under CI=true
    from mlflow import MlflowClient

    d, summary, events, config = _record(tmp_path)
    summary["comm_volume"] = {"total_bytes": 1751040.0}
    # MLflow 3 keeps the file store only on request; a sqlite store would need full mlflow (sqlalchemy)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    rid = sinks.write_mlflow(d, summary, events, config)
    client = MlflowClient()
    r = client.get_run(rid)
    assert r.info.status == "FINISHED" and r.info.run_name == "run1"
    assert client.get_experiment(r.info.experiment_id).name == "hand"
    assert r.data.params["adapter.name"] == "ddp" and r.data.params["trainer.batch_size"] == "8"
    assert r.data.tags["adapter"] == "ddp"
    losses = client.get_metric_history(rid, "train/step_loss")
    assert [m.value for m in sorted(losses, key=lambda m: m.step)] == pytest.approx(
        [v for e in events for v in e["train_losses"]]
    )
    assert [
        m.value for m in sorted(client.get_metric_history(rid, "time/epoch_s"), key=lambda m: m.step)
    ] == pytest.approx([4.0, 2.0])
    assert r.data.metrics["summary/comm_bytes_per_step"] == 1751040.0
    # through write_sinks, a failed run is marked FAILED
    summary["status"] = "failed"
    (d / "summary.json").write_text(json.dumps(summary))
    out = sinks.write_sinks(d, mllog=False, mlflow=True)
    assert client.get_run(out["mlflow"]).info.status == "FAILED"
