"""The run record's fields, once: every key of an epoch event (events.jsonl), of summary.json and of
env.json, with its unit and meaning.

Writers go through it (bench/runner/meter.py builds the event and bench/runner/summary.py the summary with `build`;
bench/core/records.py refuses a top-level key not listed here), results/README.md's field table is
`markdown()` (tests/test_schema.py keeps the two equal), and tests/test_schema.py checks that every
key a real run writes, and every key analysis/, core/sinks.py and memory_study.py read, is listed.
A renamed key therefore fails a test instead of silently emptying a figure.

A nested dict is a Field of kind "dict" (a JSON list of dicts: "table") with its own fields;
`closed=False` lists the usual keys of a nested dict written elsewhere (an adapter's settings, the
cost models) without refusing others. Fields without keys of their own are written as `rows`, one a line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# ptbench.core.timing.PHASES (tests/test_schema.py keeps them equal): not imported, as it imports torch and
# the records module (sweeps, drivers) must not
PHASES = ("data", "forward", "backward", "forward_backward", "optimizer")


class SchemaError(ValueError):
    """A record key that is not in this schema (a writer's bug, named with its fix)."""


@dataclass(frozen=True)
class Field:
    name: str
    unit: str  # "" when the value has none (a name, a flag, a text)
    meaning: str
    kind: str = "scalar"  # scalar | list (of scalars) | dict | table (a list of dicts)
    fields: tuple[Field, ...] = ()  # dict / table: the keys of the nested dict (of each row)
    closed: bool = True  # dict / table: a key not in `fields` is an error (False: the keys listed are the usual ones)


def F(name: str, unit: str, meaning: str, *fields: Field, kind: str = "scalar", closed: bool = True) -> Field:
    if fields and kind == "scalar":
        kind = "dict"
    return Field(name, unit, meaning, kind, tuple(fields), closed)


def T(name: str, meaning: str, *fields: Field, closed: bool = True) -> Field:
    """A list of dicts (one per rank, per save, per restart, ...)."""
    return Field(name, "", meaning, "table", tuple(fields), closed)


def OPEN(name: str, meaning: str, *fields: Field) -> Field:
    """A dict whose keys its writer owns (an adapter's settings, a cost model): the usual keys listed."""
    return Field(name, "", meaning, "dict", tuple(fields), False)


def rows(table: str) -> tuple[Field, ...]:
    """Fields one a line as results/README.md shows them, `name | unit | meaning`: a unit ending in "(list)" for a
    list of scalars, "(open)" for a dict whose keys its writer owns (name[]: a list of them); a line indented
    deeper continues the meaning above it, "#" starts a comment."""
    lines = [line for line in table.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    margin = min(len(line) - len(line.lstrip()) for line in lines)
    parsed: list[list[str]] = []
    for line in lines:
        if line[margin] == " ":
            parsed[-1][2] += " " + line.strip()
        elif len(parts := [part.strip() for part in line.split("|", 2)]) == 3:
            parsed.append(parts)
        else:
            raise SchemaError(f"schema row {line.strip()!r} is not 'name | unit | meaning': add the missing '|'")
    return tuple(_row(*row) for row in parsed)


def _row(name: str, unit: str, meaning: str) -> Field:
    if unit == "(open)":  # keys its writer owns: a dict, or with "[]" a list of them
        return Field(name.removesuffix("[]"), "", meaning, "table" if name.endswith("[]") else "dict", (), False)
    return F(name, unit.removesuffix("(list)").rstrip(), meaning, kind="list" if unit.endswith("(list)") else "scalar")


# --- shared parts ------------------------------------------------------------------------------------
STATE_BYTES = rows("""
params              | bytes  | parameters this rank holds
grads               | bytes  | gradients this rank holds (sharded adapters: its shard)
optimizer           | bytes  | optimizer state this rank holds
grads_peak_backward | bytes  | ZeRO: the full gradients held during backward, before the reduction
params_tp_sharded   | bytes  | Megatron: the part of params split over tensor-parallel ranks
device              |        | where the states are: a device, or {part: device} (offload)
stash               | bytes  | pipedream: weight storage its stash held beside the live weights, counted (the peak
    over the run)
stash_predicted     | bytes  | pipedream: the memory model's stash for this rank's stage (stash_per_stage)
per_partition[]     | (open) | GPipe: the states of each partition and its device
per_device[]        | (open) | the states on each device of the rank
""")
# ptbench.workloads.base.Workload.metrics
VAL_METRICS = rows("""
val_loss           | nats     | mean validation loss per sample (vision) or token (language)
val_samples        | samples  | validation samples evaluated
val_accuracy       | fraction | top-1 validation accuracy (vision)
val_perplexity     |          | exp(val_loss) (language)
val_token_accuracy | fraction | next-token accuracy (language)
""")
MEMORY = F(
    "memory",
    "bytes",
    "the rank's peak memory over the epoch's training steps (reset each epoch, and after the warm-up steps)",
    *rows("""
    peak_allocated    | bytes | CUDA max_memory_allocated (null on CPU)
    peak_reserved     | bytes | CUDA max_memory_reserved (null on CPU)
    outside_allocator | bytes | CUDA: device bytes in use outside the caching allocator at the epoch end (mem_get_info
        total - free - memory_reserved): CUDA context, NCCL buffers, workspaces, other processes; absent on CPU
    peak_rss          | bytes | host VmHWM of the process (always; holds the whole interpreter)
    peak_rss_delta    | bytes | peak_rss minus the RSS before the epoch's first step: what training added
    """),
    T(
        "per_device",
        "a process driving several devices (GPipe): one reading per device",
        *rows("""
        device         |       | the device
        peak_allocated | bytes |
        peak_reserved  | bytes |
        peak_rss       | bytes |
        """),
        closed=False,
    ),
)
RANK = (
    F("rank", "", "global rank"),
    F("host", "", "host name"),
    MEMORY,
    F(
        "memory_warmup",
        "bytes",
        "in the epoch in which the warm-up ended: the rank's peaks over the warm-up steps (cuDNN autotuning, "
        "compilation, the memory ledger's step; those of this epoch), read and then reset (memory.end_warmup); an "
        "epoch whose every step was warm-up has them in its memory too",
        *rows("""
        peak_allocated | bytes  | CUDA max_memory_allocated (null on CPU)
        peak_reserved  | bytes  | CUDA max_memory_reserved (null on CPU)
        peak_rss       | bytes  | host VmHWM of the process
        per_device[]   | (open) | GPipe: one reading per device
        reset          |        | whether every reset took (CPU: /proc/self/clear_refs written; CUDA: always)
        """),
    ),
    OPEN("state_bytes", "model-state bytes this rank holds (ptbench.adapters.base.Adapter.state_bytes)", *STATE_BYTES),
    F("epoch_time_s", "s", "this rank's epoch time"),
    F(
        "saved_activations",
        "",
        "what autograd saved in the last untimed step on this rank (memory.SavedTensorLedger; null: not counted)",
        *rows("""
        peak_bytes    | bytes        | most saved bytes alive at once
        total_bytes   | bytes        | distinct storages saved over the step
        tensors       | count        | saves
        per_partition | bytes (list) | gpipe: each partition's (device's) own peak, in partition order
        """),
    ),
    F("step_peak", "bytes", "the optimizer phase's peak beyond its start, last untimed step (memory.StepPeak)"),
    F(
        "host_syncs",
        "",
        "trainer.count_syncs: host-device synchronisations in the epoch's timed steps (bench/runner/syncs.py; "
        "null: not counted)",
        *rows("""
        explicit_per_step | count (list) | synchronize calls per timed step
        implicit_per_step | count (list) | synchronising ops (item, cpu, D2H copies) per timed step
        sites             | count        | 'kind path:line' -> calls over the timed steps, most first
        method            |              | what was counted (CUDA: sync debug mode; CPU twin: host reads of device
            tensors)
        """),
    ),
)
COMPILE_EVENT = rows("""
train_frames      | count | frames torch._dynamo compiled during the epoch's training steps
train_time_s      | s     | torch._dynamo compile time during the training steps
timed_step_frames | count | frames compiled after the warm-up (recompiles inside timed steps)
eval_frames       | count | frames compiled during validation
eval_time_s       | s     | compile time during validation
""")

# --- events.jsonl: one epoch event per line ---------------------------------------------------------
EPOCH_EVENT = (
    *rows("""
    type                  |          | "epoch"
    epoch                 | epoch    | 0-based epoch index
    steps                 | steps    | optimizer steps in the epoch
    timed_steps           | steps    | steps in the step statistics (after trainer.untimed_steps of the run)
    warmup_steps_excluded | steps    | steps of this epoch left out as warm-up
    global_batch          | samples  | samples per optimizer step over all replicas
    devices               | count    | world_size x devices per process
    epoch_time_s          | s        | wall time of the epoch's training steps, the slowest rank's; warm-up included,
        validation and checkpoint saving excluded
    partial               |          | true when cut short (trainer.max_steps, a stop): left out of epoch-time means
    val_time_s            | s        | validation time
    wall_time_s           | s        | since the start of training (this attempt) at the end of validation
    step_time_mean_s      | s        | mean step time after warm-up (per step the slowest rank)
    step_time_p50_s       | s        | median step time
    step_time_p95_s       | s        | 95th percentile step time
    step_time_cv          |          | coefficient of variation of the step time
    step_times_s          | s (list) | every timed step's time (per step the slowest rank, warm-up excluded), rounded to
        1 us: the median's bootstrap interval in the report
    """),
    *(F(f"{p}_time_mean_s", "s", f"mean time of phase `{p}` per timed step, mean over ranks") for p in PHASES),
    *rows("""
    data_share               | fraction    | data_time_mean_s / step_time_mean_s
    samples_per_s            | samples/s   | global_batch / step_time_mean_s
    epoch_samples_per_s      | samples/s   | samples of the epoch / epoch_time_s (warm-up included)
    tokens_per_s             | tokens/s    | samples_per_s x tokens per sample (language)
    train_flops_per_sample   | FLOP        | analytic training FLOPs per sample (3 x forward; see flops_check)
    flops_per_s              | FLOP/s      | achieved: samples_per_s x train_flops_per_sample
    mfu                      | fraction    | flops_per_s / (peak FLOP/s x devices); only against a known peak, never > 1
    mfu_note                 |             | why there is no MFU
    train_loss               | nats        | mean over the epoch's steps of the per-step loss (mean over ranks)
    train_losses             | nats (list) | every step's loss (trainer.log_step_losses)
    lr_epoch_start           |             | learning rate of the epoch's first step
    lrs                      | (list)      | with an lr schedule: every step's learning rate
    memory_metric            |             | peak_allocated (CUDA) or peak_rss (CPU): what peak_memory_* compare
    peak_memory_max          | bytes       | highest memory_metric over ranks
    peak_memory_min          | bytes       | lowest memory_metric over ranks
    peak_memory_after_warmup |             | whether peak_memory_* leave the warm-up steps out (the epoch began after
        them, or every rank reset its peaks when they ended): the steady peak the memory model is set against
    warmup_peak_memory_max   | bytes       | the epoch in which the warm-up ended: highest warm-up memory_metric
    """),
    T("ranks", "one row per rank, in rank order", *RANK),
    *rows("""
    rank_step_time_mean_s | s (list) | per rank (rank order): mean of its own timed step times
    rank_comm_wait_s      | s (list) | per rank: exposed communication (waiting in collectives) per profiled step
        (trainer.profile); null when no step of the epoch was profiled
    slowest_rank          |          | the rank with the most step time outside collective waits (else the longest step)
    slowest_rank_by       |          | which rule named slowest_rank
    """),
    *VAL_METRICS,
    F("checkpoint_time_s", "s", "time spent saving checkpoints in this epoch (left out of epoch_time_s)"),
    F(
        "epoch_time_estimate",
        "",
        "trainer.timing_sample: the epoch ended once its step time was measured well enough; its whole time is an "
        "ESTIMATE (bench/runner/sampling.py), not a measurement",
        *rows("""
        estimate             |       | always true: an estimate
        value_s              | s     | epoch_time_s (the part measured) + mean step time x the steps left
        lo_s                 | s     | the same with the 95 % interval's lower bound of the mean step time
        hi_s                 | s     | the same with its upper bound
        steps_measured       | steps | steps run in this epoch (warm-up included)
        timed_steps_measured | steps | timed steps the interval is over
        steps_in_epoch       | steps | steps of the whole epoch
        half_width_pct       | %     | the 95 % interval's half-width / mean step time when measuring stopped
        target_pct           | %     | trainer.timing_sample
        stopped_by           |       | interval (half-width under target) | cap (trainer.timing_sample_cap)
        """),
    ),
    F("compile", "", "trainer.compile: torch._dynamo counters over the epoch", *COMPILE_EVENT),
    *rows("""
    resumed              |        | the epoch ran in two attempts; its losses and step times are the parts joined
    resumed_at_step      | steps  | global step of the checkpoint the epoch resumed from
    restart_gap_excluded |        | the time between the attempts is left out of epoch_time_s
    memory_note          |        | what the memory readings of a resumed epoch cover
    diverged_at_step     | steps  | global step of the first non-finite training loss (its value written null)
    nonfinite            | (list) | fields whose non-finite value (NaN, inf) was written null
    """),
)

# --- summary.json -----------------------------------------------------------------------------------
SAVE = rows("""
step          | steps  | global step saved
epoch         | epoch  | epoch of the save
step_in_epoch | steps  | steps of that epoch done
reason        |        | every | stop
time          | Unix s | when saved
bytes         | bytes  | size on disk
save_time_s   | s      | time the save took
name          |        | checkpoint folder name
""")
# ptbench.core.layout.Layout.as_dict()
LAYOUT = rows("""
world_size          | count | processes
dp                  | count | data-parallel replicas
tp                  | count | tensor-parallel ranks per replica
pp                  | count | pipeline stages per replica
devices_per_process | count | devices one process drives (GPipe: its partitions)
microbatches        | count | micro-batches per replica batch inside one step (pipelines)
devices             | count | world_size x devices_per_process = dp x tp x pp
""")
SUMMARY = (
    # identity: every summary, whatever its status (ptbench.core.records.RunWriter, RunPlan.identity)
    *rows("""
    run_id           |        | the record folder's name
    experiment       |        | results.experiment
    point            |        | sweep point id: the run's identity over repeats
    adapter          |        | adapter name
    workload         |        | workload name
    world_size       | count  | processes
    devices          | count  | world_size x devices per process
    overrides        | (list) | a point a driver never ran: its overrides
    # outcome
    status           |        | running / ok / failed / oom / timeout / preempted / interrupted / killed / diverged /
        skipped / dry_run
    error            |        | one line: why the run failed
    diverged_at_step | steps  | status diverged: global step of the first non-finite training loss
    nonfinite        | (list) | fields whose non-finite value (NaN, inf) was written null
    """),
    F(
        "previous_record",
        "",
        "a resumed attempt: the unfinished record it took over (kept when the attempt fails)",
        *rows("""
        run_id           |        |
        status           |        |
        error            |        |
        steps            | steps  |
        epochs_completed | epochs |
        """),
    ),
    F("failed_rank", "", "the rank whose error is the cause"),
    T("rank_errors", "every rank's error, earliest first", F("rank", "", ""), F("status", "", ""), F("error", "", "")),
    F("resuming_from", "", "status running: the checkpoint being resumed"),
    F(
        "owner",
        "",
        "status running: the process that will write the final status (a reader finds it gone: `killed`)",
        *rows("""
        host    |        | its host
        pid     |        | its process id
        started | Unix s | its start time (tells a reused pid apart)
        """),
    ),
    F(
        "requeue",
        "",
        "a stop inside a requeueable Slurm job",
        *rows("""
        slurm_job_id |        | the job requeued
        time         | Unix s | when
        error        |        | scontrol requeue's error
        """),
    ),
    F("stop_signal", "", "the signal that stopped the run (preempted, interrupted)"),
    # checkpoints and restarts
    F(
        "checkpoint",
        "",
        "trainer.checkpoint_every / resume: the saves (null when off)",
        *rows("""
        every   | steps | trainer.checkpoint_every
        keep    | count | trainer.checkpoint_keep
        on_stop |       | a stop signal saves
        format  |       | the adapter's checkpoint format
        """),
        T("saved", "every save of the record, earlier attempts' included", *SAVE),
        F("latest", "", "the newest checkpoint kept"),
    ),
    T(
        "resumed_from",
        "one row per restart of this record",
        *rows("""
        step                | steps  | global step resumed at
        epoch               | epoch  |
        step_in_epoch       | steps  |
        time                | Unix s | when resumed
        attempt             | count  | the attempt (the first is 1)
        checkpoint          |        | checkpoint name
        checkpoint_time     | Unix s | when it was saved
        restart_gap_s       | s      | from the save to the resume
        previous_run_id     |        | the record saved into
        previous_status     |        | that record's status
        events_replaced     |        | epochs whose events were rewritten
        host                |        | host of the resumed attempt
        slurm_job_id        |        |
        slurm_restart_count |        |
        """),
    ),
    *rows("""
    restart_gap_excluded      |         | restart gaps are left out of the epoch times
    # totals (ptbench.runner.summary)
    startup_s                 | s       | launch of the command to the end of the first step
    epochs_completed          | epoch   | epochs with an event
    total_time_s              | s       | training time of the run (all attempts, restart gaps excluded)
    steps                     | steps   | optimizer steps of the run
    global_batch              | samples | samples per optimizer step over all replicas
    local_batch               | samples | samples per rank per micro-step
    samples_dropped_per_epoch | samples | the incomplete last global batch
    data_workers              | count   | DataLoader workers per rank
    """),
    OPEN(
        "data_pipeline",
        "loader and input settings as used (pin_memory, persistent_workers; vision: channels_last, cudnn_benchmark, "
        "decoder, cache)",
        *rows("""
        bad_images           |        | imagefolder: data.bad_images (fail: a damaged file ends the run; skip: counted
            here)
        images_skipped       | count  | imagefolder: image files rank 0 found damaged and skipped (data.bad_images=skip)
        images_skipped_files | (list) | imagefolder: the first 10 of those files
        channels_last         | bool   | vision: activations in NHWC (workload.channels_last)
        channels_last_weights | bool   | vision: weights in NHWC too (false where the adapter keeps NCHW weights: zero,
            fsdp, horovod)
        """),
    ),
    F(
        "compile",
        "",
        "trainer.compile (null when off)",
        *rows("""
        backend           |       | trainer.compile_backend
        how               |       | what the adapter compiled
        time_s            | s     | torch._dynamo's compile time
        frames            | count |
        graphs            | count |
        warmup_steps      | steps |
        timed_step_frames | count | frames compiled after the warm-up
        """),
    ),
    *rows("""
    step_time_mean_s                 | s         | mean step time over the timed steps of all epochs
    samples_per_s                    | samples/s | global_batch / step_time_mean_s
    tokens_per_s                     | tokens/s  | samples_per_s x tokens per sample (language)
    epoch_time_mean_s                | s         | mean over whole epochs (over all, flagged, when every epoch was cut
        short)
    epoch_time_mean_includes_partial |           | epoch_time_mean_s includes cut-short epochs
    epoch_time_steady_s              | s         | mean over whole epochs after the first: what speedup uses
    """),
    F(
        "timing",
        "",
        "how steps were timed",
        *rows("""
        clock       |  | CUDA events or the host clock
        phase_sync  |  | per-phase device sync (trainer.sync_timing)
        count_syncs |  | host-device syncs counted (trainer.count_syncs): a diagnostic on the hot path
        """),
    ),
    F("tf32", "", "trainer.tf32"),
    F("warnings", "", "what makes the numbers suspect (input-bound, recompiles, no MFU)", kind="list"),
    F(
        "contention_sampled",
        "",
        "the machine sampled every interval_s during the run (bench/runner/contention.py): by the local launcher, "
        "or under torchrun/srun by global rank 0 for its node only; `contention:` warnings from it",
        *rows("""
        scope                |          | what was sampled: machine (local launch) or rank0_node (torchrun/srun: rank
            0's node)
        interval_s           | s        | sampling interval
        samples              | count    | intervals measured
        span_s               | s        | time the intervals cover
        cpus                 | count    | CPUs of the sampling process's affinity (the CPUs sampled)
        other_busy_cpus_mean | CPUs     | mean CPUs kept busy by processes not of this run
        other_busy_cpus_max  | CPUs     | the highest interval's value of other_busy_cpus_mean
        steal_share          | fraction | steal time / (span x cpus): CPU time the hypervisor gave elsewhere
        own_busy_cpus_mean   | CPUs     | mean CPUs this run's processes used (launcher/torchrun agent/slurmstepd,
            ranks, children)
        loadavg_1m_max       |          | highest 1-minute load average seen (this run included)
        sampler_cpu_s        | s        | the CPU time of the sampler's samples (time.thread_time around each) over the
            run
        sampler_cpu_share    | fraction | sampler_cpu_s / span_s: the share of one core the observer took
        gpu_other_pids       |          | CUDA: {device: pids} of other processes on our GPUs (NVML; -1: pid unknown)
        gpu_error            |          | why the GPUs could not be watched (NVML missing or failing)
        """),
    ),
    F(
        "memory_ledger",
        "",
        "predicted vs counted saved-activation bytes (ptbench.core.memory_model.ledger_fields); null: not counted",
        *rows("""
        predicted_saved_bytes        | bytes        | the memory model's saved activations of the busiest rank
        counted_saved_bytes_per_rank | bytes (list) | saved-tensor hooks, last untimed step, peak (gpipe: per partition)
        counted_saved_bytes          | bytes        | the most any rank (gpipe: partition) counted
        ratio                        |              | predicted / counted
        rule                         |              | what is counted (storages once, parameters and buffers excluded)
        model                        |              | the file of the memory model
        error                        |              | why nothing was counted
        predicted_step_bytes         | bytes        | the memory model's step_transient (busiest rank)
        counted_step_bytes_per_rank  | bytes (list) | each rank's step_peak
        counted_step_bytes           | bytes        | the most any rank's optimizer phase held beyond its start
        step_ratio                   |              | predicted_step_bytes / counted_step_bytes
        step_rule                    |              | what the step side measures
        """),
    ),
    F(
        "flops_check",
        "",
        "the MFU cross-check: analytic vs counted training FLOPs (ptbench.core.flops.flops_check)",
        *rows("""
        formula_train_flops_per_sample | FLOP | the workload's formula (what MFU uses)
        counted_train_flops_per_sample | FLOP | torch.utils.flop_counter.FlopCounterMode, meta device
        ratio                          |      | counted / formula
        convention                     |      | what the counter counts (attention, causal mask, what is left out)
        warning                        |      | set when the two differ by more than 5 % (also in warnings)
        error                          |      | why nothing was counted
        """),
    ),
    T("state_bytes_per_rank", "the last epoch's model-state bytes per rank", *STATE_BYTES, closed=False),
    *rows("""
    hosts                    | (list)   | host per rank, in rank order
    val_loss                 | nats     | the last epoch's
    val_accuracy             | fraction | the last epoch's
    val_perplexity           |          | the last epoch's
    train_loss               | nats     | the last epoch's
    peak_memory_max          | bytes    | the last epoch's
    peak_memory_min          | bytes    | the last epoch's
    peak_memory_after_warmup |          | the last epoch's: whether its peaks leave the warm-up steps out
    warmup_peak_memory_max   | bytes    | the warm-up steps' own peak (highest memory_metric over ranks)
    mfu                      | fraction | the last epoch's
    # the run's setup (ptbench.runner.rank)
    adapter_settings         | (open)   | the adapter's settings as used (Adapter.describe)
    plan                     | (open)   | the run plan (ptbench.runner.plan.RunPlan.describe)
    """),
    F("layout", "", "how the run is laid out over devices (ptbench.core.layout.Layout)", *LAYOUT),
    F("precision", "", "fp32 / bf16 / fp16 as run"),
    OPEN(
        "predicted_memory",
        "predicted peak memory of the busiest rank (ptbench.core.memory_model)",
        *rows("""
        params            | bytes        |
        grads             | bytes        |
        optimizer         | bytes        |
        master            | bytes        |
        model_states      | bytes        |
        transient         | bytes        |
        step_transient    | bytes        | held only during the optimizer step (the optimizer's temporaries; DeepSpeed
            1-3 also the fp32 gradient partition and the norm's fp64 copies); total = model_states + max(transient +
            activations, step_transient)
        step_optimizer    | bytes        | the optimizer's own temporaries within step_transient (foreach /
            single-tensor)
        activations       | bytes        |
        saved_activations | bytes        | the part of activations autograd saves (the memory ledger's prediction)
        formula           |              | per part, the formula used (framework settings named)
        stash             | bytes        | an asynchronous pipeline's stashed weight versions on the busiest stage (in
            model_states)
        stash_per_stage   | bytes (list) | each stage's stash: copies (pipedream S-1-s, 2bw 1) x the stage's parameter
            bytes
        total             | bytes        | the predicted peak
        device_bytes      | bytes        | memory of the device
        fits              |              | total <= device_bytes
        variant           |              |
        busiest           |              |
        """),
    ),
    OPEN(
        "comm_volume",
        "predicted communication per optimizer step per rank (ptbench.core.comm_volume)",
        *rows("""
        total_bytes   | bytes  | bus volume per step per rank
        backend       |        |
        by_op         | bytes  | per collective op
        phases        |        | the timed phases the collectives run in
        collectives[] | (open) | one row per collective
        error         |        | why there is no volume
        """),
    ),
    F(
        "profile",
        "",
        "trainer.profile: the profiled window and what its traces measure (bench/runner/profiling.py)",
        *rows("""
        activities   | (list) | torch.profiler activities (cpu, cuda)
        traces       | (list) | per rank, its Chrome/Perfetto trace file
        merged_trace |        | all ranks in one trace (pid = rank)
        merge_error  |        | why no merged trace was written
        note         |        | why there is no measurement
        """),
        F("window", "", "global steps profiled", F("start", "step", "the first"), F("count", "steps", "how many")),
        F(
            "export",
            "",
            "stopping the profiler, writing and reading back each rank's trace: after the last profiled step's timer",
            *rows("""
            seconds       | s (list) | per rank, what it took
            in_step_times |          | whether any step time holds it (false)
            in_epoch_time |          | whether the epoch time holds it (false)
            note          |          | where it ran
            """),
        ),
        T(
            "ranks",
            "per rank, per profiled step",
            *rows("""
            rank           |   |
            step_time_s    | s | mean profiled step (adapter.train_step)
            comm_time_s    | s | time collectives ran (union)
            exposed_comm_s | s | communication not overlapped by compute
            compute_s      | s | compute (aten operators on CPU, kernels on CUDA), union
            by_kind        |   | collective kind -> {calls, message_bytes, bus_bytes, time_s}
            """),
        ),
        T(
            "ledger",
            "per collective kind: formula vs measured bytes per step (busiest rank, nccl-tests bus volume)",
            *rows("""
            kind           |       | all_reduce, all_gather, reduce_scatter, broadcast, send_recv, ...
            formula_bytes  | bytes | corrected formula (comm_volume.corrected)
            measured_bytes | bytes | from the traces' c10d ops
            ratio          |       | measured / formula
            calls          | count | collectives per step
            time_s         | s     | measured time per step, mean over ranks
            """),
        ),
        OPEN(
            "formula",
            "the corrected formula (comm_volume.corrected): comm_volume's fields, corrected",
            F("differences", "", "each framework difference from the papers' formula, with its setting", kind="list"),
            F("uncorrected_total_bytes", "bytes", "comm_volume's total before the corrections"),
        ),
        F("notes", "", "how group sizes and dtypes were taken", kind="list"),
        OPEN(
            "bubble",
            "pipeline bubble per stage beside (p-1)/(m+p-1) (ptbench.core.trace_ledger.bubble)",
            *rows("""
            schedule           |                 | ADAPTER SCHEDULE that ran (pipeline 1f1b, megatron 1f1b, ...)
            stages             | count           | pipeline stages p
            microbatches       | count           | micro-batches m per step
            steps              | steps           | profiled steps measured
            marks              | count (list)    | per stage, {fwd, bwd}: ptbench.stage marks per profiled step
            nested_marks       | count           | marks inside another mark on the same stage (0: each item marked
                once)
            marked_once        |                 | every stage marks m forwards and m backwards per step, none nested
            per_stage          | fraction (list) | wall: idle share of the schedule's span per stage
            mean               | fraction        | wall: mean over stages
            per_step           | fraction (list) | wall: mean over stages, per profiled step (the spread of `mean`)
            item_cv            | (open)          | fwd / bwd: coefficient of variation of the work items' durations over
                every stage and profiled step (the theory's equal stages: 0)
            step_item_cv       | (list)          | per profiled step: std/mean of its work items' durations, each
                divided by its stage's median item of that direction (the theory's equal items: 0)
            steady_cv          |                 | the largest step_item_cv of a steady step (trace_ledger.STEADY_CV)
            steady_steps       | steps           | profiled steps whose step_item_cv is at most steady_cv
            steady_mean        | fraction        | wall: mean of per_step over the steady steps (none steady: null)
            steady_ratio       |                 | steady_mean / theory
            theory             | fraction        | (p-1)/(m+p-1)
            ratio              |                 | mean / theory
            replayed_per_stage | fraction (list) | the measured work items re-timed, one device per stage
            replayed_mean      | fraction        | replayed: mean over stages
            replayed_ratio     |                 | replayed_mean / theory
            definition         |                 | how both are measured
            """),
        ),
    ),
    *rows("""
    extra                | (open)  | the config's free `extra` group
    batch_reduced_from   | samples | the batch size a driver lowered to fit
    phase_semantics      | (open)  | what each timed phase holds for this adapter
    precision_semantics  |         | what "bf16"/"fp16" means for this adapter
    batch_policy         |         | adapter.batch_policy: what a global batch follows
    warmup_steps         | steps   | trainer.untimed_steps
    launcher             |         | local / torchrun / slurm / horovodrun
    conventions          | (open)  | how the numbers were measured (ptbench.runner.meter.CONVENTIONS)
    frameworks_imported  | (list)  | frameworks besides torch this process imported
    cpu_threads_per_rank | count   | torch intra-op threads per rank
    """),
    F(
        "rank_environment",
        "",
        "variables CUDA reads when it starts (the launcher puts them in each rank's environment)",
        OPEN("required", "name -> value the adapter needs (megatron TP > 1: CUDA_DEVICE_MAX_CONNECTIONS=1)"),
        OPEN("at_start", "name -> value rank 0 started with (null: unset), read before CUDA starts"),
    ),
    # python -m ptbench.scale: rank R of W on torch's fake process group, 2 steps (bench/scale/); no times
    F(
        "dry_run",
        "",
        "present only in a dry run's record (status dry_run): never a timing, never read by timing answers",
        *rows("""
        rank            |        | the rank that ran (of world_size)
        steps           | steps  | training steps run (the last compared)
        seconds         | s      | wall time of the dry run, plan included (not a step time)
        standins        | (list) | what stood in for what the fake backend lacks (bench/scale/standins.py)
        standin_reasons | (open) | stand-in -> what it replaces and why
        ledger[]        | (open) | the last step's collectives: op, group_size, count, buffer_bytes, bus bytes
        comm            | (open) | formula vs ledger bytes per step: by_op {formula, ledger, count, ratio}, ratio
        tracker         | (open) | torch's MemTracker: peak_total, at_peak, category_peaks, step_start (bytes)
        cannot_check    |        | what a dry run cannot check (time, overlap, NCCL algorithms, losses, ...)
        """),
        OPEN(
            "memory",
            "model vs tracker",
            *rows("""
            parts      | (open) | per part (params, grads, ..., total): {model, tracker, ratio, read}
            worst_part |        | the part furthest from 1
            worst      |        | its ratio (model over tracker)
            """),
        ),
    ),
)

# --- env.json ---------------------------------------------------------------------------------------
ENV = (
    F("python", "", "Python version"),
    OPEN(
        "versions",
        "package -> version: torch, torchvision, hydra-core, nvtx and each adapter's framework",
        F("torch", "", ""),
    ),
    *rows("""
    host              |              | host name
    platform          |              |
    cpu               |              |
    cpu_count         | count        |
    system            | (open)       | torch.utils.collect_env's probes: os, libc, gcc, cpu_info (lscpu), cuda_runtime,
        nvidia_driver, gpu_models, cudnn (None where a probe is unavailable)
    package_version   |              | the ptbench package's version (None: not installed)
    git_sha           |              | the checkout's commit at launch (None: not a git checkout, e.g. an installed
        wheel)
    git_dirty         |              | tracked files differed from git_sha at launch (None: no checkout)
    slurm             | (open)       | SLURM_* ids of the job
    time              |              | ISO time of the record's creation
    cuda_available    |              |
    cuda              |              | torch's CUDA version
    gpus              | (list)       | GPU names
    gpu_count         | count        |
    gpu_memory_bytes  | bytes (list) | per GPU
    cudnn             |              |
    nccl              |              |
    tf32              | (open)       | TF32 flags (matmul, cudnn)
    gpu_env           | (open)       | NCCL_* / CUDA_* variables
    driver            |              | NVIDIA driver
    nvidia_smi_gpus[] | (open)       | the GPUs as NVML lists them (nvidia-ml-py): name, memory, bus_id
    topology          |              | nvidia-smi topo -m
    """),
)

FILES = {"events.jsonl": EPOCH_EVENT, "summary.json": SUMMARY, "env.json": ENV}


def unknown(record: dict, fields=SUMMARY, prefix: str = "", deep: bool = True, closed: bool = True) -> list[str]:
    """The keys of `record` not in `fields`, as dotted paths (a table's rows as name[]); `deep` also
    looks into the nested dicts the schema lists (an open one only at the keys it lists)."""
    known = {f.name: f for f in fields}
    out = []
    for key, value in record.items():
        f = known.get(key)
        if f is None:
            out += [prefix + key] if closed else []
            continue
        if not deep or f.kind not in ("dict", "table"):
            continue
        rows = [value] if f.kind == "dict" else value if f.kind == "table" and isinstance(value, list) else []
        for row in (r for r in rows if isinstance(r, dict)):
            out += unknown(row, f.fields, f"{prefix}{key}{'[]' if f.kind == 'table' else ''}.", deep, f.closed)
    return list(dict.fromkeys(out))


def check(record: dict, fields=SUMMARY, what: str = "summary.json", deep: bool = False) -> dict:
    """`record` itself; raises SchemaError naming the first key the schema does not list."""
    bad = unknown(record, fields, deep=deep)
    if bad:
        raise SchemaError(
            f"{what} key {bad[0]!r} is not in ptbench/core/schema.py: add it there (name, unit, "
            f"meaning) or fix the writer's spelling"
        )
    return record


def names(fields=None) -> set[str]:
    """Every field name at any depth (of one file's fields, or of all files)."""
    out: set[str] = set()
    for f in fields if fields is not None else [f for fs in FILES.values() for f in fs]:
        out.add(f.name)
        out |= names(f.fields)
    return out


def _rows(fields, prefix: str = ""):
    for f in fields:
        name = prefix + f.name + ("[]" if f.kind == "table" else "")
        unit = f.unit + (" (list)" if f.kind == "list" else "")
        meaning = f.meaning + ("" if f.closed else " (open: its writer may add keys)")
        yield f"| `{name}` | {unit} | {meaning} |"
        yield from _rows(f.fields, name + ".")


def markdown() -> str:
    """The field tables of results/README.md."""
    parts = []
    for file, fields in FILES.items():
        parts += [f"### {file}", "", "| field | unit | meaning |", "|---|---|---|", *_rows(fields), ""]
    return "\n".join(parts)


BEGIN, END = "<!-- schema:begin (python -m ptbench.core.schema results/README.md) -->", "<!-- schema:end -->"


def readme_block(text: str) -> str | None:
    """The generated part of a README (between the markers), None without markers."""
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def write_readme(path: Path) -> None:
    text = Path(path).read_text()
    if readme_block(text) is None:
        raise SystemExit(f"error: {path} has no '{BEGIN}' ... '{END}' markers; add them where the tables go")
    head, rest = text.split(BEGIN, 1)
    Path(path).write_text(f"{head}{BEGIN}\n{markdown()}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1:
        write_readme(Path(sys.argv[1]))
    else:
        print(markdown())
