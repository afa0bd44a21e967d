"""trainbench: one harness that runs the same workload under different parallel-training frameworks.

Layers, lowest first; no module imports a layer above its own (tests/test_layers.py checks):
  bench.core     plumbing: config schema, errors, process group, timers, memory, FLOPs, records
  workloads      models, data, loss, metrics, FLOPs
  adapters       one file per framework behind adapters/base.py; their config schemas
  bench.runner   composing the config, checks, the run plan, launching, one rank, the training loop
  bench.*        drivers, each a command: `python -m bench` (one run), bench.sweep, bench.smoke,
                 bench.demo, bench.overhead, bench.memory_study, bench.comm, bench.model_speed
  analysis       reads records only (it imports none of the above)
"""
