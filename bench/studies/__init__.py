"""Studies and maintainers' benchmarks: commands that measure the harness, the models and the memory model,
kept apart from the users' commands at bench/'s top. Each is `python -m ptbench.studies.<name>`:

  ledger           the communication ledger (bytes from traces beside the corrected formulas) and the bubble
  memory_ledger    predicted vs counted saved-activation bytes per adapter x workload
  memory_study     model-state bytes per rank beside the ZeRO formulas and the memory model (--step,
                   --deepspeed-estimators: memory_study_ds.py)
  overhead         the harness's step against a bare hand-written loop, data-loading shares, startup
  model_speed      the harness GPT-2 beside megatron-core's and Hugging Face's
  report_scale     how long the report takes on thousands of synthetic records

variants.py is the one table of adapter variants the studies run; tally.py the line per finished run;
memory_points.py what the two memory-study modules share. Their results, dated: bench/MEASUREMENTS.md.
No circle among them or anywhere in ptbench (tests/test_no_cycles.py); bench/'s top imports none of them.
"""
