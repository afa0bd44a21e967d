"""`python -m ptbench.studies.memory_study --deepspeed-estimators`: the memory model beside DeepSpeed's own
estimators (estimate_zero2/zero3_model_states_mem_needs, model_to_params), called for real."""

from __future__ import annotations

import pytest

from ptbench.studies import memory_study as ms
from ptbench.studies import memory_study_ds as ds

PSI, LARGEST, N = 1_000_000, 100_000, 4  # a known parameter count; hand-computed bytes below (bf16, Adam)


def _row(rows, variant, n=N):
    (row,) = [r for r in rows if r["variant"] == variant and r["n"] == n]
    return row


def test_table_numbers_match_hand_computed_bytes():
    rows = ds.ds_rows("hand", PSI, LARGEST, [N, 64])
    # stage 2: ours 2Ψ bf16 params + (2 bf16 grads + 8 moments + 4 master) Ψ/N; DeepSpeed 2Ψ + 18Ψ/N
    z2 = _row(rows, "zero2")
    assert z2["ours"] == 2 * PSI + 14 * PSI / N == 5_500_000
    assert z2["ds"] == 2 * PSI + 18 * PSI // N == 6_500_000
    # at the step ours adds the fp32 gradient partition (part of predict's step_transient: DeepSpeed's reason A)
    assert z2["ours_step"] == z2["ours"] + 4 * PSI / N == z2["ds"]
    assert z2["ratio"] == 1.0 and z2["reasons"] == [] and z2["unexplained"] == 0
    # 64 GPUs = 8 nodes of 8: the GPU estimate depends on the total only
    assert _row(rows, "zero2", 64)["ds"] == 2 * PSI + int(18 * PSI / 64) == 2_281_250
    # offloaded optimizer: both keep only the 2-byte parameters on the GPU (the gradient partition on the host)
    off = _row(rows, "zero2 off-opt")
    assert off["ours"] == off["ours_step"] == off["ds"] == 2 * PSI and off["reasons"] == []
    # stage 3: ours 16Ψ/N; DeepSpeed 4 x largest layer + 18Ψ/N = 4e5 + 4.5e6
    z3 = _row(rows, "zero3")
    assert z3["ours"] == 16 * PSI / N == 4_000_000
    assert z3["ds"] == 4 * LARGEST + 18 * PSI // N == 4_900_000
    assert z3["ours_step"] == 20 * PSI / N  # + the step's fp32 gradient partition (A)
    assert dict(z3["reasons"]) == {"B": 400_000, "C": -500_000} and z3["unexplained"] == 0
    assert z3["ours_gathered"] == 4_000_000 + 2 * LARGEST * (N - 1) / N  # predict's transient gathered unit
    z3o = _row(rows, "zero3 off-opt")
    assert (z3o["ours"], z3o["ds"]) == (2 * PSI / N, 4 * LARGEST + 2 * PSI // N) == (500_000, 900_000)
    assert z3o["ours_step"] == z3o["ours"]  # offload_optimizer: the fp32 gradient partition is on the host
    z3p = _row(rows, "zero3 off-opt+par")
    assert (z3p["ours"], z3p["ds"], z3p["ratio"]) == (0, 4 * LARGEST, None)
    assert all(abs(r["unexplained"]) <= 1 for r in rows)


def test_deepspeed_estimators_called_directly_agree():
    assert ds.ds_estimate(2, PSI, LARGEST, N, False, False) == 6_500_000
    assert ds.ds_estimate(3, PSI, LARGEST, 16, False, False) == 4 * LARGEST + 18 * PSI // 16
    assert ds.ds_nodes(64, 8) == (8, 8) and ds.ds_nodes(2, 8) == (2, 1)
    with pytest.raises(ValueError, match="--gpus 12 is not a multiple of --gpus-per-node 8"):
        ds.ds_nodes(12, 8)


def test_model_to_params_of_gpt2_tiny():
    # V h (tied embedding and head, counted once) + s h + L (12 h^2 + 13 h) + 2 h, V=50257, h=128, s=64, L=2
    total, largest = ds.ds_model_params(["workload=gpt2_tiny"])
    assert total == 50257 * 128 + 64 * 128 + 2 * (12 * 128**2 + 13 * 128) + 2 * 128 == 6_837_888
    assert largest == 50257 * 128  # the token embedding / LM head


def test_command_prints_the_comparison(capsys):
    assert ms.main(["--deepspeed-estimators", "--workloads", "gpt2_tiny", "--gpus", "1", "2"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("gpt2_tiny ")]
    assert len(rows) == len(ds.DS_ROWS) * 2
    # zero2 at 2 GPUs: Ψ = 6,837,888 -> ours (2Ψ + 7Ψ) = 58.7 MiB, at the step + 2Ψ (4Ψ/N) = DeepSpeed (2Ψ + 9Ψ)
    z2 = next(r for r in rows if r.split()[1:3] == ["zero2", "2"]).split()
    assert z2[3:8] == ["58.7", "71.7", "-", "71.7", "1.000"]
    assert "UNEXPLAINED" not in out and "DeepSpeed has no stage-1 estimator" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "12"], "error: --gpus 12 is not a multiple of --gpus-per-node 8"),
        (["--workloads", "nope"], "error: --workloads nope:"),
        (["--timing"], "error: --deepspeed-estimators runs on its own"),
    ],
)
def test_bad_input_is_one_line(capsys, argv, message):
    assert ms.main(["--deepspeed-estimators", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
