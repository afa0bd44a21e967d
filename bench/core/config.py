"""Structured-config schema of the harness (plumbing: imports no workload, adapter or runner).

`BenchConfig` is the schema of the whole tree (conf/config.yaml). The `adapter` group is typed by
the small base `AdapterConfig` (name, batch_policy); each adapter's own schema is a subclass that
lives with the adapters (adapters/configs.py) and is stored in the ConfigStore under group
`adapter`, so `adapter=ddp adapter.stage=3` fails in Hydra (DDPConfig has no `stage`) before any
rank starts. The runner registers both (bench/runner/compose.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class WorkloadConfig:
    name: str = MISSING  # registry key, e.g. gpt2_tiny, resnet50
    kind: str = MISSING  # vision | language
    arch: str = MISSING  # vgg16 | resnet50 | gpt2
    # vision
    num_classes: int = 10
    image_size: int = 32
    width_div: int = 1  # divide every conv width by this (tiny CPU variants); 1 = the real model
    # language (GPT-2)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    seq_len: int = 1024
    dropout: float = 0.0
    # vision: conv weights (and so activations) in channels_last memory format; None = on CUDA only
    # (tensor-core convolutions want NHWC), off on CPU (workloads/vision.py use_channels_last)
    channels_last: bool | None = None
    # vision: torch.backends.cudnn.benchmark (cuDNN times its convolution algorithms per input shape and keeps
    # the fastest); None = on CUDA only (workloads/vision.py use_cudnn_benchmark), recorded in data_pipeline
    cudnn_benchmark: bool | None = None


@dataclass
class OptimizerConfig:
    name: str = "adamw"  # sgd | adam | adamw | lamb | lars
    lr: float = 1e-3
    weight_decay: float = 0.01  # the paper's "L2"
    momentum: float = 0.9
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8


@dataclass
class ScheduleConfig:
    """Learning-rate schedule (conf/lr_schedule/*.yaml; bench/core/schedule.py): a factor on optimizer.lr,
    stepped once per optimizer step. Lengths are in `unit`s (epoch: x the run's steps per epoch)."""

    name: str = "constant"  # constant | step | warmup_poly | warmup_cosine
    unit: str = "epoch"  # epoch | step: the unit of warmup, step_size and total
    warmup: float = 0.0  # linear warm-up length (warmup_*): factor (k + 1) / warmup_steps at step k
    step_size: float = 30.0  # step: multiply by gamma every step_size units
    gamma: float = 0.1
    power: float = 2.0  # warmup_poly: decay exponent
    total: float = 0.0  # warmup_*: where the decay ends; 0 = trainer.epochs (the whole run)
    end_factor: float = 0.0  # warmup_*: lr at the end of the decay = end_factor x optimizer.lr


@dataclass
class DataConfig:
    source: str = "synthetic"  # synthetic | imagefolder | wikitext
    root: str | None = None  # imagefolder: folder with train/ and val/; wikitext: folder with train.txt/valid.txt
    tokenizer_dir: str | None = None  # GPT-2 BPE files (vocab.json + merges.txt)
    cache_dir: str | None = None  # token-id memmap cache; default $XDG_CACHE_HOME/trainbench (~/.cache/trainbench)
    train_samples: int = 2048  # synthetic only
    val_samples: int = 512  # synthetic only
    # DataLoader workers per rank; None = from the CPUs per rank (SLURM_CPUS_PER_TASK, else the CPUs
    # of the node shared by its ranks), minus the rank's own: min(8, cpus - 1)
    num_workers: int | None = None
    augment: bool = True  # vision: torchvision reference train transforms
    # imagefolder: torchvision = torchvision.io.decode_image (libjpeg-turbo) and the reference transforms on
    # uint8 tensors; pil = PIL images through the same transforms (torchvision's reference path, slower)
    decoder: str = "torchvision"
    # imagefolder: decode every image once into RAM (uint8) before training, so steps only crop/flip;
    # for small datasets (refused when the estimate exceeds a quarter of the free memory)
    cache_decoded: bool = False
    # imagefolder: a file that cannot be decoded: fail = end the run in one line naming it; skip = name it
    # once, use the next good file in its place, and count it in the record (data_pipeline.images_skipped)
    bad_images: str = "fail"


@dataclass
class AdapterConfig:
    """Base of every adapter's schema (adapters/configs.py holds one subclass per adapter)."""

    name: str = MISSING
    # how the global batch follows the device count: per_device (DDP/ZeRO: fixed per-GPU batch),
    # linear (Megatron: batch grows with GPU count), fixed (PipeDream: fixed mini-batch),
    # per_microbatch (GPipe: batch_size is the micro-batch, replica batch = batch_size x microbatches)
    batch_policy: str = "per_device"


BATCH_POLICIES = ("per_device", "linear", "fixed", "per_microbatch")


@dataclass
class LauncherConfig:
    name: str = "local"  # local | torchrun | slurm
    nprocs: int = 2  # local only: ranks to spawn on this machine (conf/launcher/local.yaml: one per visible GPU)
    backend: str = "auto"  # auto = nccl on GPU, gloo on CPU
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 = pick a free port (local) / derive from the job id (slurm)
    # CPU threads per rank; 0 = SLURM_CPUS_PER_TASK under Slurm, else 1 (ranks sharing a small box's
    # cores: more threads slowed 2-rank runs 5-50x on 2 cores)
    threads_per_rank: int = 0
    # local only: how the launcher starts its ranks. auto = fork on a machine with no visible GPU (the
    # ranks inherit the launcher's imported torch instead of importing it again: ~5 s less per run on
    # 2 cores), spawn when CUDA is visible (a CUDA runtime does not survive fork) | spawn | fork
    start_method: str = "auto"
    # local only: none | cores. cores = each rank bound to its own share of the launcher's CPUs (its affinity
    # split evenly in local-rank order; more ranks than CPUs: ranks share a CPU round-robin), as Slurm's
    # srun --cpu-bind=cores, DeepSpeed's launcher --bind_cores_to_rank and torchrun's --numa-binding do
    cpu_bind: str = "none"


@dataclass
class TrainerConfig:
    epochs: int = 1
    max_steps: int = 0  # > 0 stops each epoch after this many optimizer steps
    batch_size: int = 8  # per device (per data-parallel rank); see adapter.batch_policy
    grad_accum: int = 1
    untimed_steps: int = 2  # excluded from step statistics (stated in the record)
    eval_every_epoch: bool = True
    # validation batches per rank per epoch; None = trainer.max_steps when that is set (a 20 s run no longer
    # validates for 40 s), else all; 0 = the whole validation set (the epoch event's val_samples)
    max_eval_batches: int | None = None
    grad_clip: float = 0.0  # 0 = off; always passed explicitly to frameworks that clip by default
    precision: str = "fp32"  # fp32 | bf16 | fp16 (GPU only)
    # torch.compile of the model (adapters that declare support: ddp, fsdp, zero); compilation runs in the
    # warm-up steps, so trainer.untimed_steps must be >= 1; its time and any recompiles are recorded
    compile: bool = False
    compile_backend: str = "inductor"  # torch.compile backend; aot_eager/eager skip code generation (tests)
    # CUDA: TF32 tensor cores for fp32 matmuls and convolutions (torch.backends.cuda.matmul / cudnn
    # allow_tf32), applied on every rank and recorded; MFU then uses the TF32 peak
    tf32: bool = False
    seed: int = 1234
    # process-group timeout; 0 = trainer.hang_timeout_s + 60 s, so the watchdog (which writes the
    # `timeout` record) always fires before the backend kills the ranks
    dist_timeout_s: int = 0
    hang_timeout_s: float = 900.0  # watchdog: no step/eval progress this long = status timeout; 0 = off
    # steps between agreements on a preemption signal: each is a tiny CPU all-reduce that also
    # lines the ranks up; every step cost ~2-5 % on 50 ms CPU steps (ptbench.studies.overhead), every 10 is noise
    stop_check_every: int = 10
    # CUDA: phases are timed by CUDA events (no host sync); true adds a device sync at every phase end, a
    # diagnostic that serialises host and device and slows frameworks that overlap host work (recorded)
    sync_timing: bool = False
    # host-device synchronisations per timed step with their source lines, per rank (bench/runner/syncs.py):
    # a diagnostic (python -m ptbench.gpu_check turns it on) that wraps synchronising calls
    count_syncs: bool = False
    progress: bool | None = None  # tqdm bars; None = only when stdout is a terminal (not in batch logs)
    # without a bar (a batch log): one progress line at step 1 and every this many steps or validation
    # batches (torchtitan's log_freq); 0 = none
    log_every: int = 10
    log_step_losses: bool = True
    # sampled timing (bench/runner/sampling.py): end each epoch once the 95 % interval of the mean step
    # time is within +-this % of it (or after timing_sample_cap timed steps, 0 = no cap); the epoch's time is then
    # recorded as an estimate (epoch_time_estimate). 0 = full epochs (the default)
    timing_sample: float = 0.0
    timing_sample_cap: int = 0
    # Fault injection for resilience tests: "KIND@RANK:STEP", KIND = raise | oom | hang | exit; or
    # "slow@FRACTION": every step FRACTION longer on every rank (the noise-floor check, bench/runner/faults.py);
    # "straggler@RANK:FRACTION": every step FRACTION longer on rank RANK only (the straggler check)
    inject_fault: str | None = None
    # "START:COUNT": torch.profiler over COUNT optimizer steps from global step START (0-based): a Chrome/Perfetto
    # trace per rank in RUN_DIR/traces/ (+ merged.json), the communication ledger, exposed communication,
    # pipeline bubble and per-rank collective waits in the record (bench/runner/profiling.py); None = off
    profile: str | None = None
    # A deterministic stop for tests of preemption and resume: "RANK:STEP" = that rank is asked to stop
    # right after global step STEP, as by SIGUSR1 (the ranks agree at the next stop check)
    inject_stop: str | None = None
    # Checkpoints (bench/core/checkpoint.py) under RUN_DIR/checkpoints/step-NNNNNN: every this many global
    # steps (0 = none), and on a stop signal whenever checkpoint_every > 0 or resume=auto; the newest
    # checkpoint_keep are kept. epoch_time_s leaves the time spent saving out (checkpoint_time_s)
    checkpoint_every: int = 0
    checkpoint_keep: int = 2
    # auto: continue the newest unfinished record of the same point (results.point) from its newest
    # checkpoint, in that record; never: always a fresh run (the default: a benchmark record is one
    # uninterrupted attempt unless asked; slurm/run.sbatch passes auto so requeued jobs resume)
    resume: str = "never"
    # the memory model's verdict before launch (bench/core/memory_model/; it is an estimate, about -30 %/+50 %):
    # warn = one line with its numbers when the busiest rank's prediction exceeds 90 % of the device, and run;
    # refuse = refuse such a run before launch; off = predict and record only
    memory_check: str = "warn"


@dataclass
class ResultsConfig:
    root: str = "results"
    experiment: str = "default"
    run_id: str | None = None  # None = generated (time + host + random), unique across requeues
    # Sweep point id (bench/runner/points.py): a hash of the run's command-line overrides, stored in the
    # summary. None = computed from the overrides; set it to name a point yourself.
    point: str | None = None
    # true: skip the run if <root>/<experiment> already holds an ok record of the same point
    skip_done: bool = False
    # repeat index of the point (python -m ptbench.sweep run --repeats N); not part of the point's identity
    repeat: int = 0
    # parent folder of the run's record; None = <root>/<experiment> (a Hydra multirun uses its sweep folder)
    dir: str | None = None
    # standard sinks written from the finished record (bench/core/sinks.py), never required:
    mllog: bool = False  # MLPerf-logging `:::MLLOG` lines in RUN_DIR/mllog.txt (needs the `mllog` extra)
    tensorboard: bool = False  # TensorBoard scalars in RUN_DIR/tensorboard/ (needs the tensorboard package)
    wandb: bool = False  # a W&B run (extra `wandb`; offline in RUN_DIR/wandb unless WANDB_API_KEY is set)
    mlflow: bool = False  # an MLflow run at MLFLOW_TRACKING_URI (extra `mlflow`)


@dataclass
class BenchConfig:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    adapter: AdapterConfig = MISSING  # one of the adapter schemas (adapters/configs.py)
    data: DataConfig = field(default_factory=DataConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    results: ResultsConfig = field(default_factory=ResultsConfig)
    extra: Any = None  # free-form notes copied into the record


def store_schema(cs: ConfigStore) -> None:
    """The whole tree's schema: conf/config.yaml names it first in its defaults list."""
    cs.store(name="bench_schema", node=BenchConfig)
