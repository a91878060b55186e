"""The JobConfig schema: one dataclass per TOML section (the sections about scaling out are in
``scale_sections.py`` and re-exported here).

Each field's docstring (the string literal under it) is its ``--help`` text.
Fields whose feature lands later still exist here with their defaults, so a TOML
written today never needs rewriting; they are listed in ``planned.py`` (PLANNED_FIELDS), and
programs that run a job refuse a non-default value for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torchtitan.config.scale_sections import (
    MX,
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    FaultTolerance,
    Float8,
    MemoryEstimation,
    Parallelism,
)


@dataclass
class Job:
    config_file: str | None = None
    """TOML file to read the job config from (values in it override the defaults)."""

    dump_folder: str = "./outputs"
    """Folder for everything a run writes: checkpoints, traces, TensorBoard logs, saved config."""

    description: str = "default job"
    """Free-text description of the job, logged at start."""

    use_for_integration_test: bool = False
    """Marks a bundled config as part of the integration test suite."""

    print_config: bool = False
    """Log the fully resolved config at start."""

    save_config_file: str | None = None
    """If set, write the resolved config as TOML to this file name inside ``dump_folder``."""

    custom_config_module: str = ""
    """Python module defining a ``JobConfig`` dataclass that extends this one with extra sections or fields."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Collect torch.profiler traces."""

    save_traces_folder: str = "profile_traces"
    """Folder (under dump_folder) for profiler traces."""

    profile_freq: int = 10
    """Take a trace (and a memory snapshot) every this many steps."""

    profiler_active: int = 1
    """Number of steps recorded in each profiler trace."""

    profiler_warmup: int = 3
    """Number of warm-up steps before each profiler trace is recorded."""

    enable_memory_snapshot: bool = False
    """Record the CUDA caching allocator's history and dump snapshots (CUDA only)."""

    save_memory_snapshot_folder: str = "memory_snapshot"
    """Folder (under dump_folder) for memory snapshot pickles."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log metrics every this many steps (and at step 1 and the last step)."""

    enable_tensorboard: bool = False
    """Write metrics to TensorBoard."""

    disable_color_printing: bool = False
    """Print console metrics without ANSI colours."""

    save_tb_folder: str = "tb"
    """Folder (under dump_folder) for TensorBoard event files."""

    save_for_all_ranks: bool = False
    """Write TensorBoard/W&B metrics from every rank (default: only the rank that owns the loss)."""

    enable_wandb: bool = False
    """Log metrics to Weights & Biases (set WANDB_MODE=offline to run without network)."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family, a key of the model registry."""

    flavor: str = "debugmodel"
    """Model size/config within the family, e.g. debugmodel, 1B, 8B, 70B, 405B."""

    hf_assets_path: str = "./tests/assets/tokenizer"
    """Folder holding the tokenizer (tokenizer.model / tokenizer.json) and, optionally, HF weights."""

    tokenizer_path: str | None = None
    """Deprecated: path to a tokenizer file. Prefer hf_assets_path; when set, this file is used."""

    converters: list[str] = field(default_factory=list)
    """Model converters applied after building, e.g. float8 (comma separated)."""

    attn_mask_type: Literal["causal", "block_causal"] | None = None
    """Attention mask; None: the flavor's (causal for the Llama 3 sizes). block_causal: tokens
    attend only within their own document of a packed sequence (split at BOS/EOS)."""

    use_flex_attn: bool | None = None
    """FlexAttention kernel on GPUs (on CPU: SDPA with the same mask); None: the flavor's, or
    compiled FlexAttention where attention_backend=auto times it fastest (CUDA, no CP)."""

    sliding_window_size: int | None = None
    """Attend to at most this many positions back; None: the flavor's (unlimited)."""

    attention_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    """SDPA kernel of the causal and boolean-mask attention. auto: on CUDA, the fastest kernel
    that matches the math kernel, timed once at start-up on this run's attention shape (one log
    line), compiled FlexAttention among them when use_flex_attn is unset and context parallel
    is off; elsewhere PyTorch's choice.
    flash / cudnn / efficient / math: that kernel only, refused in one line where it cannot run."""

    print_after_conversion: bool = False
    """Print the model after converters are applied."""


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer to use."""

    lr: float = 8e-4
    """Peak learning rate."""

    beta1: float = 0.9
    """Adam beta1."""

    beta2: float = 0.95
    """Adam beta2."""

    eps: float = 1e-8
    """Adam epsilon."""

    weight_decay: float = 0.1
    """Weight decay (decoupled for AdamW)."""

    implementation: Literal["for-loop", "foreach", "fused"] = "fused"
    """Optimizer kernel: fused (falls back to foreach where unsupported), foreach or for-loop."""

    clip_in_step: bool = True
    """Clip gradients (training.max_norm) inside the fused Adam/AdamW step, dividing each
    gradient by the clip factor as the kernel reads it, instead of rescaling every gradient
    first: one pass over the gradients fewer, the same update up to float rounding (bitwise the
    same while nothing is clipped). Other implementations rescale the gradients."""

    early_step_in_backward: bool = False
    """Step the optimizer per parameter during backward to free gradients early (no clipping)."""

    state_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of Adam's exp_avg / exp_avg_sq. bfloat16 halves the optimizer state (8 -> 4 bytes
    per parameter) and cuts the step's memory traffic from 28 to 20 bytes per parameter, for
    rounding the stored moments to bfloat16 (8 significant bits) after each step; the update
    math and the parameters stay float32. Needs beta1, beta2 <= 0.996 and implementation fused."""

    override_checkpoint_lr: bool = False
    """On resume, use this config's lr as the peak lr instead of the one saved in the checkpoint."""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warm-up from near zero to the peak learning rate."""

    decay_ratio: float | None = None
    """Fraction of the steps spent decaying at the end (warmup-stable-decay). None: decay right after warm-up."""

    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay phase."""

    min_lr_factor: float = 0.0
    """Learning rate at the end of decay, as a fraction of the peak."""


@dataclass
class DataLoader:
    num_workers: int = 0
    """Worker processes for the dataloader (0: load in the training process)."""

    persistent_workers: bool = False
    """Keep dataloader workers alive between epochs."""

    pin_memory: bool = False
    """Pin host memory for faster host-to-device copies."""

    prefetch_factor: int | None = None
    """Batches prefetched per worker (only with num_workers > 0)."""


@dataclass
class Training:
    dataset: str = "c4_test"
    """Dataset name from the registry (c4, c4_test, c4_validation) or any name with dataset_path;
    or a mix of weighted sources "NAME[=PATH]:WEIGHT,..." (e.g. "c4_test:0.7,mine=/d.jsonl:0.3",
    drawn per packed sequence with debug.seed; docs/datasets.md)."""

    dataset_path: str | None = None
    """Local path (file or folder: json/jsonl/parquet/txt) to load the dataset from."""

    local_batch_size: int = 8
    """Batch size per data-parallel rank per microbatch."""

    global_batch_size: int = -1
    """Global batch size; when larger than local_batch_size x dp, gradients are accumulated. -1: local x dp."""

    seq_len: int = 2048
    """Sequence length in tokens."""

    max_norm: float = 1.0
    """Gradient-norm clipping threshold (<= 0 disables clipping; the norm is still logged)."""

    loss_implementation: Literal["auto", "logits", "chunked"] = "auto"
    """How the loss comes from the last hidden states. logits: the output projection makes the
    [tokens, vocab] logits, then float32 cross-entropy. chunked: the projection is fused with
    the cross-entropy loss_chunk_size tokens at a time, so the logits never exist whole (less
    memory, the same numbers up to float rounding). auto: chunked on CUDA, logits elsewhere
    (and where the output projection is converted, e.g. float8 without "output" in
    filter_fqns, or a family declares its own loss)."""

    loss_chunk_size: int = 8192
    """Tokens per chunk of the chunked loss (memory: chunk x vocab logits at a time)."""

    weight_copies: Literal["auto", "on", "off"] = "auto"
    """Under autocast on one device: keep a copy of each linear layer's weight in the compute
    dtype, written by the optimizer step, instead of casting every weight in every forward and
    every weight gradient back to float32 (less memory traffic and gradient memory; the same
    numbers up to float32 rounding in the norm and the AdamW step). auto: on CUDA where it
    applies (one device, autocast, one microbatch per step, the fused optimizer default,
    clipping in the step), for the layers where the copy replaces autocast's own cast (no
    memory cost). on: float8 linears too (they cast their copy, as under FSDP's bf16 mixed
    precision: faster, but 2 bytes a parameter of memory the plain float8 path never holds)."""

    steps: int = 10000
    """Number of training steps."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype without FSDP (bfloat16 trains fully in bf16, no autocast); FSDP keeps
    float32 parameters and applies mixed_precision_param."""

    enable_cpu_offload: bool = False
    """Offload parameters, gradients and optimizer state to the CPU (FSDP2)."""

    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype: FSDP/HSDP cast parameters to it (mixed-precision policy); every other
    layout (one device, DDP, TP or PP without FSDP) runs its forward under torch.autocast to it
    with float32 parameters. float32 turns mixed precision off."""

    mixed_precision_reduce: Literal["float32"] = "float32"
    """Gradient reduction dtype under FSDP mixed precision."""

    gc_freq: int = 50
    """Run Python garbage collection every this many steps (automatic GC is disabled)."""

    gc_debug: bool = False
    """Collect garbage every step to find where GC is triggered (slow)."""

    dataloader: DataLoader = field(default_factory=DataLoader)
    """Dataloader options."""


@dataclass
class Experimental:
    custom_import: str = ""
    """Module imported at start, e.g. to register a custom model."""


@dataclass
class Validation:
    enable: bool = False
    """Run a validation loop during training."""

    dataset: str = "c4_validation"
    """Validation dataset name."""

    dataset_path: str | None = None
    """Local path of the validation dataset."""

    local_batch_size: int = 8
    """Validation batch size per data-parallel rank."""

    seq_len: int = 2048
    """Validation sequence length."""

    freq: int = 500
    """Validate every this many steps."""

    steps: int = -1
    """Validation steps per run (-1: exhaust the validation set)."""


@dataclass
class Debug:
    seed: int | None = None
    """Random seed (the same on every DP/TP/CP rank; seed + pp rank per pipeline stage). Unset: 42 with deterministic, else random (logged)."""

    deterministic: bool = False
    """Use deterministic algorithms (bitwise-reproducible runs; slower)."""

    deterministic_warn_only: bool = False
    """Deterministic mode (implies deterministic), only warning about ops without a deterministic implementation."""

    moe_force_load_balance: bool = False
    """Route MoE tokens round-robin (debugging load balance)."""


@dataclass
class JobConfig:
    """Everything a training run is configured with."""

    job: Job = field(default_factory=Job)
    profiling: Profiling = field(default_factory=Profiling)
    metrics: Metrics = field(default_factory=Metrics)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    mx: MX = field(default_factory=MX)
    comm: Comm = field(default_factory=Comm)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    experimental: Experimental = field(default_factory=Experimental)
    validation: Validation = field(default_factory=Validation)
    debug: Debug = field(default_factory=Debug)
