"""Communication bytes per optimizer step per rank: pure formulas (no torch or framework import at module level).

The reference page, with the units, every formula, its sources and what is not modelled:
bench/core/comm_volume/README.md.

`volume(sharding, params=..., world_size=..., ...)` returns the bytes one rank moves per optimizer step in each
collective, and their total; `compose(Inputs)` is the same from the grouped inputs (the run's `Layout` and the
adapter's `CostInputs`, as the run plan carries them, with the parameter count, the activation and the element
sizes). `volume_run(cfg, plan, build_model)` fills them from a composed config and its run plan (the one call
the runner and the dry run make), so no adapter is named here; `record_fields` is the record's `comm_volume`
field and `corrected` sets the papers' formulas to what the frameworks move. Seconds at a bus bandwidth
measured by `python -m ptbench.comm` are the report's business (analysis/tables.py `comm_time`).

The modules: inputs.py (the inputs and the keyword form), items.py (one collective, the ring factors, the
timed phases), papers.py (`volume` / `compose`: [ZeRO], [Megatron], [SP], the pipeline sends), fsdp.py
(FSDP2's padding, root unit and BatchNorm all-reduce), megatron.py (the vocab-parallel layers and sequence
parallelism as megatron-core moves them), corrected.py (`corrected`), run.py (`volume_run`, `record_fields`).
"""

from ptbench.core.comm_volume.corrected import corrected
from ptbench.core.comm_volume.fsdp import fsdp_padded, norm_grad_all_reduce, norm_shapes, padded_elements
from ptbench.core.comm_volume.inputs import Activation, ElementBytes, Inputs
from ptbench.core.comm_volume.items import item, ring_factor
from ptbench.core.comm_volume.megatron import busiest_stage, vocab_parallel
from ptbench.core.comm_volume.papers import DP_SYNC, compose, volume
from ptbench.core.comm_volume.run import MODEL, record_fields, volume_run

__all__ = [
    "DP_SYNC",
    "MODEL",
    "Activation",
    "ElementBytes",
    "Inputs",
    "busiest_stage",
    "compose",
    "corrected",
    "fsdp_padded",
    "item",
    "norm_grad_all_reduce",
    "norm_shapes",
    "padded_elements",
    "record_fields",
    "ring_factor",
    "vocab_parallel",
    "volume",
    "volume_run",
]
