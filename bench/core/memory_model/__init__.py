"""Predicted memory per rank of each adapter: pure formulas (no torch or framework import at module level).

The reference page, with every formula, its sources and what is not modelled: bench/core/memory_model/README.md.

`predict(sharding, params=..., world_size=..., ...)` returns the bytes the busiest rank (the busiest device, for
gpipe, which drives several from one process) should hold: parameters, gradients, optimizer state, DeepSpeed's
fp32 master copy, transient buffers, activations and the optimizer step's temporaries, and their total;
`compose(Inputs)` is the same from the grouped inputs. `predict_run(cfg, plan, build_model)` fills them from a
composed config and its run plan (the one call the runner makes): the layout, the adapter's cost inputs
(ptbench.core.layout) and the model's facts come from the plan, so no adapter is named here. `fits(total,
device_bytes)` says whether a total fits a device; `device_bytes()` is the memory a rank may use here.

The modules: inputs.py (the input groups), states.py (model states), activations.py, step.py (the optimizer
step's temporaries), compose.py (`predict`), counting.py (what autograd saves, counted on the meta device),
facts.py (the model's facts, once per launch), stash.py (an asynchronous pipeline's stashed weight
versions), run.py (from a config and plan; records and the table). The
runtime instruments the ledger compares against (StepPeak, SavedTensorLedger) are in ptbench.core.memory.
"""

from ptbench.core.memory_model.activations import (
    attention_keeps_scores,
    loss_bytes,
    loss_bytes_per_token_vocab,
)
from ptbench.core.memory_model.compose import compose, fits, predict
from ptbench.core.memory_model.counting import (
    activation_elements,
    even_split,
    gpt2_saved_elements,
    pipeline_layers,
    stage_activation_elements,
    stage_input_elements,
    tp_local_block,
)
from ptbench.core.memory_model.facts import model_facts, run_facts, vision_units
from ptbench.core.memory_model.inputs import (
    GIB,
    MIB,
    OPTIMIZER_STATE_BYTES,
    PARTS,
    PRECISIONS,
    REPLICATED,
    ZERO3_SUB_GROUP_SIZE,
    ActivationInputs,
    Inputs,
    ModelFacts,
    Training,
)
from ptbench.core.memory_model.run import (
    check_fits,
    device_bytes,
    ledger_fields,
    memory_warning,
    plan_memory,
    predict_run,
    record_fields,
    table,
)
from ptbench.core.memory_model.stash import stage_params, stash_copies, stash_per_stage
from ptbench.core.memory_model.states import (
    flat_partition,
    fsdp_backward_buffers,
    gpt2_replicated_under_tp,
    gpt2_stage_params,
    numel,
    optimizer_state_bytes,
    zero3_gathered,
)
from ptbench.core.memory_model.step import (
    STEP_IMPLS,
    TORCH_OPTIMIZERS,
    harness_step_groups,
    optimizer_temporaries,
    rank_step_groups,
    torch_step_impl,
)

__all__ = [
    "GIB",
    "MIB",
    "OPTIMIZER_STATE_BYTES",
    "PARTS",
    "PRECISIONS",
    "REPLICATED",
    "STEP_IMPLS",
    "TORCH_OPTIMIZERS",
    "ZERO3_SUB_GROUP_SIZE",
    "ActivationInputs",
    "Inputs",
    "ModelFacts",
    "Training",
    "activation_elements",
    "attention_keeps_scores",
    "check_fits",
    "compose",
    "device_bytes",
    "even_split",
    "fits",
    "flat_partition",
    "fsdp_backward_buffers",
    "gpt2_replicated_under_tp",
    "gpt2_saved_elements",
    "gpt2_stage_params",
    "harness_step_groups",
    "ledger_fields",
    "loss_bytes",
    "loss_bytes_per_token_vocab",
    "memory_warning",
    "model_facts",
    "numel",
    "optimizer_state_bytes",
    "optimizer_temporaries",
    "pipeline_layers",
    "plan_memory",
    "predict",
    "predict_run",
    "rank_step_groups",
    "record_fields",
    "run_facts",
    "stage_params",
    "stash_copies",
    "stash_per_stage",
    "stage_activation_elements",
    "stage_input_elements",
    "table",
    "torch_step_impl",
    "tp_local_block",
    "vision_units",
    "zero3_gathered",
]
