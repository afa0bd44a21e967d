"""trainbench: one harness that runs the same workload under different parallel-training frameworks.

Layers, lowest first; no module imports a layer above its own (tests/test_layers.py checks):
  ptbench.core     plumbing: config schema, errors, process group, timers, memory, FLOPs, records
  workloads      models, data, loss, metrics, FLOPs
  adapters       one file per framework behind adapters/base.py; their config schemas
  ptbench.runner   composing the config, checks, the run plan, launching, one rank, the training loop
  bench.*        drivers, each a command: `python -m ptbench` (one run), ptbench.sweep, ptbench.smoke,
                 ptbench.demo, ptbench.paper, ptbench.comm, ptbench.compare, ptbench.predict, ptbench.scale;
                 the studies and maintainers' benchmarks apart in ptbench.studies (memory_study, ledger, ...)
  analysis       reads records only, through ptbench.core.readers (a leaf that imports nothing of ptbench)
"""
