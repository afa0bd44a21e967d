"""Predict, then check: step time per adapter at link speeds, device counts and micro-batch counts not
measured, from the parts a results folder already holds, with the error on the user's own runs beside it.

    python -m ptbench.predict RESULTS_DIR --target 'adapter=zero link=300'   # predict points
    python -m ptbench.predict RESULTS_DIR --target 'adapter=fsdp launcher.nprocs=64'   # at W, from a dry run
    python -m ptbench.predict RESULTS_DIR                                    # leave-one-out error table
    python -m ptbench.predict validate                                       # two-node Slurm + tc, as root

The model (bench/predict/model.py): step = compute + e x communication (+ the pipeline bubble), where
communication = sum over the record's collectives (bench/core/comm_volume/) of calls x (alpha + S / beta)
fitted by least squares per collective kind and group size on `python -m ptbench.comm` reports, compute and
the exposed factor e are fitted on the measured calibration points, and the bubble scales with
(m + p - 1) / m at a fixed global batch. It refuses, in one line, what it was not calibrated for. At a device
count no run measured, a `python -m ptbench.scale` dry run at that W gives the collectives and the memory per rank
(bench/predict/at_scale.py). Runs whose records warn of contention are marked, and counted in one line.
"""
