"""ptbench.comm (measured collectives, nccl-tests bandwidths) and ptbench.core.comm_volume (bytes per step).

The measurement test runs the real CLI: 2 gloo ranks spawned by `python -m ptbench.comm`, and checks
the JSON it writes; no assertion depends on how fast the machine is.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv"]
SIZES = [1 << k for k in range(10, 21)]  # 1K .. 1M, factor 2
# nccl-tests doc/PERFORMANCE.md bus-bandwidth factors, written out independently of ptbench.comm
FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}


def _run_comm(tmp_path, *extra):
    """`--out DIR` (what a sweep passes): DIR/<backend>-2.json and the printed table as DIR/<backend>-2.txt."""
    out = tmp_path / "comm"
    cmd = [
        sys.executable,
        "-m",
        "ptbench.comm",
        "--world-size",
        "2",
        "--max-bytes",
        "1M",
        "--iters",
        "3",
        "--out",
        str(out),
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    (path,) = out.glob("*-2.json")
    report = json.loads(path.read_text())
    assert path.name == f"{report['backend']}-2.json"
    assert path.with_suffix(".txt").read_text().strip() == proc.stdout.strip()  # the table, as printed
    return report, proc.stdout


@pytest.fixture(scope="module")
def comm_run(tmp_path_factory):
    return _run_comm(tmp_path_factory.mktemp("comm"))


def test_json_has_every_op_at_every_size(comm_run):
    report, _ = comm_run
    assert report["backend"] == "gloo"
    assert report["world_size"] == 2
    assert report["device"] == "cpu"
    assert report["hosts"] and all(isinstance(h, str) and h for h in report["hosts"])
    assert report["torch_version"]
    got = {(r["op"], r["bytes"]) for r in report["results"]}
    assert got == {(op, s) for op in OPS for s in SIZES}
    assert len(report["results"]) == len(OPS) * len(SIZES)  # no duplicates
    for r in report["results"]:
        assert not r.get("na"), r  # gloo here has every op (reduce-scatter natively or by the ring)
        assert r["type"] == "float"


def test_times_positive_finite_and_data_correct(comm_run):
    report, _ = comm_run
    for r in report["results"]:
        assert math.isfinite(r["time_s"]) and r["time_s"] > 0, r
        assert math.isfinite(r["algbw_GBps"]) and r["algbw_GBps"] > 0, r
        assert r["wrong"] == 0, r
        # time is the max over ranks of the per-rank mean, so never below the mean over ranks
        assert r["time_s"] >= r["time_s_rank_mean"] * (1 - 1e-12), r


def test_bandwidths_follow_nccl_tests(comm_run):
    report, _ = comm_run
    n = report["world_size"]
    for r in report["results"]:
        # count is the per-rank element count; S is the total array for all_gather/reduce_scatter
        per_rank = r["count"] * 4
        s = per_rank * n if r["op"] in ("all_gather", "reduce_scatter") else per_rank
        assert s == r["bytes"], r
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9, rel=1e-9), r
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * FACTOR[r["op"]](n), rel=1e-9), r
    # at n = 2 the factors are concrete numbers
    by_op = {r["op"]: r for r in report["results"] if r["bytes"] == 1 << 20}
    assert by_op["all_reduce"]["busbw_GBps"] == pytest.approx(by_op["all_reduce"]["algbw_GBps"])
    assert by_op["all_gather"]["busbw_GBps"] == pytest.approx(by_op["all_gather"]["algbw_GBps"] / 2)
    assert by_op["reduce_scatter"]["busbw_GBps"] == pytest.approx(by_op["reduce_scatter"]["algbw_GBps"] / 2)
    assert by_op["broadcast"]["busbw_GBps"] == pytest.approx(by_op["broadcast"]["algbw_GBps"])


def test_table_printed_like_nccl_tests(comm_run):
    report, stdout = comm_run
    assert "algbw" in stdout and "busbw" in stdout and "#wrong" in stdout
    rows = [ln.split() for ln in stdout.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(rows) == len(report["results"])
    first = report["results"][0]
    assert rows[0][:4] == [str(first["bytes"]), str(first["count"]), "float", first["op"]]
    assert "Out of bounds values : 0 OK" in stdout


def test_ring_reduce_scatter_is_correct(tmp_path):
    """The send/recv ring used where a backend lacks reduce_scatter gives the right sums."""
    report, _ = _run_comm(tmp_path, "--ops", "reduce_scatter", "--reduce-scatter-impl", "ring", "--max-bytes", "64K")
    assert report["reduce_scatter_impl"] == "ring"
    rows = report["results"]
    assert [r["bytes"] for r in rows] == SIZES[:7]
    for r in rows:
        assert r["impl"] == "ring_send_recv" and r["wrong"] == 0, r
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] / 2, rel=1e-9)


def test_cli_rejects_bad_arguments(capsys):
    from ptbench.comm import main  # the CLI's own entry point, in-process: refused before any rank is spawned

    for args, why in (
        (["--ops", "all_reduce,alltoall"], "--ops: unknown ['alltoall']"),
        (["--min-bytes", "2M", "--max-bytes", "1M"], "need 0 < min_bytes <= max_bytes"),
        (["--max-bytes", "12Q"], "not a size: '12Q'"),
        (["--json", "x.json", "--out", "comm"], "give --json or --out, not both"),
    ):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2, args
        assert why in capsys.readouterr().err, args


def test_parse_size_and_sizes():
    from ptbench.comm import parse_size, sizes

    assert parse_size("1K") == 1024 and parse_size("256M") == 256 << 20 and parse_size("1G") == 1 << 30
    assert parse_size("4096") == 4096 and parse_size("64KiB") == 65536
    assert sizes(1024, 1 << 20, 4) == [1024, 4096, 16384, 65536, 262144, 1 << 20]
    assert sizes(1024, 3000, 2) == [1024, 2048]


# ---------------------------------------------------------------------------------------------
# comm_volume: hand-computed numbers


def test_comm_volume_has_no_torch_at_import():
    code = "import sys, ptbench.core.comm_volume; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_ddp_horovod_zero0_all_reduce():
    from ptbench.core.comm_volume import volume

    # 2 (N-1)/N * Psi * B = 2 * 3/4 * 1e6 * 4 = 6e6
    for sharding in ("none", "distributed_optimizer", "zero0"):  # ddp, horovod, megatron, zero stage 0
        v = volume(sharding, params=1_000_000, world_size=4)
        assert v["total"] == pytest.approx(6e6)
        assert v["bytes"] == {"dp_grad_all_reduce": pytest.approx(6e6)}
    # fp16 gradients halve it; one rank moves nothing
    assert volume("none", params=1_000_000, world_size=4, bytes_per_elem=2)["total"] == pytest.approx(3e6)
    assert volume("none", params=1_000_000, world_size=1)["total"] == 0
    # N = 8: 2 * 7/8 * 1e6 * 4 = 7e6
    assert volume("none", params=1_000_000, world_size=8)["total"] == pytest.approx(7e6)


def test_zero12_reduce_scatter_plus_all_gather():
    from ptbench.core.comm_volume import volume

    for stage in (1, 2):
        v = volume(f"zero{stage}", params=1_000_000, world_size=4)
        # (N-1)/N * Psi * B = 3/4 * 4e6 = 3e6 each, 6e6 together (= DDP, ZeRO paper 7.2.1)
        assert v["bytes"] == {"dp_grad_reduce_scatter": pytest.approx(3e6), "dp_param_all_gather": pytest.approx(3e6)}
        assert v["total"] == pytest.approx(6e6)


def test_zero3_and_fsdp_one_and_a_half_ddp():
    from ptbench.core.comm_volume import volume

    for sharding in ("zero3", "fsdp"):
        v = volume(sharding, params=1_000_000, world_size=4)
        assert v["total"] == pytest.approx(9e6)  # 3 * 3/4 * 4e6
        assert sorted(v["bytes"]) == ["dp_grad_reduce_scatter", "dp_param_all_gather_bwd", "dp_param_all_gather_fwd"]
    # FSDP without resharding after forward skips the backward all-gather
    assert volume("fsdp", params=1_000_000, world_size=4, reshard_after_forward=False)["total"] == pytest.approx(6e6)
    ddp = volume("none", params=10**9, world_size=64)["total"]
    assert volume("zero3", params=10**9, world_size=64)["total"] == pytest.approx(1.5 * ddp)


def test_tensor_parallel_megatron_layers():
    from ptbench.core.comm_volume import volume

    # b=2, s=1024, h=768 fp32: one activation = 2*1024*768*4 = 6,291,456 B; t=2: 2(t-1)/t = 1
    # 4 all-reduces/layer * 12 layers * 1 micro-batch * 6,291,456 = 301,989,888 B
    v = volume("none", params=124_000_000, world_size=2, tp=2, layers=12, hidden=768, seq_len=1024, micro_batch=2)
    assert v["dp"] == 1
    assert v["bytes"] == {"tp_activation_all_reduce": pytest.approx(301_989_888)}
    # t=4: factor 1.5; with 2 micro-batches x2
    v4 = volume(
        "none",
        params=124_000_000,
        world_size=4,
        tp=4,
        layers=12,
        hidden=768,
        seq_len=1024,
        micro_batch=2,
        microbatches=2,
    )
    assert v4["total"] == pytest.approx(301_989_888 * 1.5 * 2)
    # 2-D TP x DP: world 8 = tp 2 x dp 4; DP all-reduce of Psi/tp = 2 * 3/4 * 62e6 * 4
    v8 = volume("none", params=124_000_000, world_size=8, tp=2, layers=12, hidden=768, seq_len=1024, micro_batch=2)
    assert v8["dp"] == 4
    assert v8["bytes"]["dp_grad_all_reduce"] == pytest.approx(2 * 0.75 * 62e6 * 4)
    assert v8["total"] == pytest.approx(2 * 0.75 * 62e6 * 4 + 301_989_888)


def test_pipeline_and_megatron_3d():
    from ptbench.core.comm_volume import volume

    act = 4 * 512 * 1024 * 2  # b=4, s=512, h=1024, bf16 = 4,194,304 B
    # pure pipelines of 2 and 4 stages, 8 micro-batches
    v2, v4 = (
        volume(
            "none",
            params=10**8,
            world_size=stages,
            pp=stages,
            hidden=1024,
            seq_len=512,
            micro_batch=4,
            microbatches=8,
            bytes_per_elem=2,
        )
        for stages in (2, 4)
    )
    # 2 stages: each stage sends one direction
    assert v2["pp"] == 2 and v2["total"] == pytest.approx(8 * act)
    # 4 stages: an inner stage sends activations forward and gradients back
    assert v4["bytes"] == {"pp_activation_send": pytest.approx(8 * act), "pp_gradient_send": pytest.approx(8 * act)}
    # megatron t=2 p=2 d=2, 24 layers -> 12 per stage, 4 micro-batches, fp16
    v = volume(
        "none",
        params=350_000_000,
        world_size=8,
        tp=2,
        pp=2,
        layers=24,
        hidden=1024,
        seq_len=512,
        micro_batch=4,
        microbatches=4,
        bytes_per_elem=2,
    )
    assert (v["dp"], v["tp"], v["pp"]) == (2, 2, 2)
    assert v["bytes"]["dp_grad_all_reduce"] == pytest.approx(1.0 * 350e6 / 4 * 2)  # 2(2-1)/2 * Psi/(t p) * B
    assert v["bytes"]["tp_activation_all_reduce"] == pytest.approx(4 * 12 * 4 * 1.0 * act)
    assert v["bytes"]["pp_activation_send"] == pytest.approx(4 * act)
    assert v["total"] == pytest.approx(sum(v["bytes"].values()))


def test_volume_rejects_inconsistent_inputs():
    from ptbench.core.comm_volume import volume

    with pytest.raises(ValueError, match="unknown sharding"):
        volume("ddp", params=1, world_size=2)  # an adapter's name: the volume reads the sharding it states
    with pytest.raises(ValueError, match="unknown sharding"):
        volume("zero4", params=1, world_size=4)
    with pytest.raises(ValueError):
        volume("none", params=1, world_size=6, tp=4, layers=2, hidden=8, seq_len=8, micro_batch=1)
    with pytest.raises(ValueError):
        volume("none", params=1, world_size=4, tp=2)  # no activation shape
    with pytest.raises(ValueError):
        volume("none", params=1, world_size=4, dp=2)


def test_the_reports_comm_time_rule():
    """The one comm-time rule (the report's, ptbench.analysis.tables): bytes / busbw at the nearest size."""
    from ptbench.analysis.tables import busbw_at, comm_time
    from ptbench.core.comm_volume import volume

    report = {
        "backend": "gloo",
        "world_size": 4,
        "results": [
            {"op": "all_reduce", "bytes": 1 << 20, "busbw_GBps": 2.0},
            {"op": "all_reduce", "bytes": 4 << 20, "busbw_GBps": 3.0},
        ],
    }
    assert busbw_at(report, "all_reduce", 1 << 20) == (2.0, 1 << 20)
    assert busbw_at(report, "all_reduce", 100 << 20) == (3.0, 4 << 20)  # beyond range: largest size
    assert busbw_at(report, "all_gather", 1 << 20) is None
    t, how = comm_time(volume("none", params=1_000_000, world_size=4)["collectives"], "gloo", [report])
    assert t == pytest.approx(6e6 / 3e9) and "3 GB/s at 4 MiB" in how  # 4 MB gradient message -> the 4M row


def test_zero3_reuse_distance_is_the_model_not_times_the_ranks():
    """GPT-2 medium (355M parameters, under stage3_max_reuse_distance's 1e9) at 64 ranks: DeepSpeed keeps forward's
    gathers for backward (the dry run's ledger: one all-gather of the parameters per step), whatever the rank count;
    1.5B parameters exceed it and are re-gathered."""
    from ptbench.adapters import get_adapter_class
    from ptbench.core.comm_volume import corrected, record_fields, volume
    from ptbench.runner.compose import compose, typed

    cfg = typed(compose(["workload=gpt2_medium", "adapter=zero3"]))
    cost = get_adapter_class(cfg.adapter.name).cost_inputs(cfg)
    for psi, regather in ((354_823_168, False), (1_500_000_000, True)):
        fields = record_fields(volume("zero3", params=psi, world_size=64))
        names = [it["name"] for it in corrected(fields, cost, cfg.workload)["collectives"]]
        assert ("dp_param_all_gather_bwd" in names) is regather, psi
