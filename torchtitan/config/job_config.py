"""The JobConfig schema: one dataclass per TOML section.

Each field's docstring (the string literal under it) is its ``--help`` text.
Fields whose feature lands later still exist here with their defaults, so a TOML
written today never needs rewriting; they are listed in ``planned.py`` (PLANNED_FIELDS), and
programs that run a job refuse a non-default value for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


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
    """Log metrics every this many steps."""

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
    """FlexAttention kernel on GPUs (on CPU: SDPA with the same mask); None: the flavor's."""

    sliding_window_size: int | None = None
    """Attend to at most this many positions back; None: the flavor's (unlimited)."""

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

    early_step_in_backward: bool = False
    """Step the optimizer per parameter during backward to free gradients early (no clipping)."""

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
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicated data parallelism degree (DDP, or the outer dim of HSDP)."""

    enable_compiled_autograd: bool = False
    """Use compiled autograd (needed for some DDP + compile setups)."""

    data_parallel_shard_degree: int = -1
    """Sharded data parallelism degree (FSDP2); -1 uses the ranks left over by the other degrees."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """When FSDP frees gathered parameters after forward: default (not under PP), always, or never."""

    tensor_parallel_degree: int = 1
    """Tensor parallelism degree."""

    disable_loss_parallel: bool = False
    """Do not compute the loss on vocab-sharded logits under TP."""

    enable_async_tensor_parallel: bool = False
    """Overlap TP communication with compute (CUDA + compile only)."""

    pipeline_parallel_degree: int = 1
    """Pipeline parallelism degree."""

    module_fqns_per_model_part: list[list[str]] | None = None
    """Explicit module FQNs per pipeline model part (overrides layers_per_stage)."""

    pipeline_parallel_first_stage_less_layers: int = 1
    """Layers fewer on the first stage, to balance the embedding."""

    pipeline_parallel_last_stage_less_layers: int = 1
    """Layers fewer on the last stage, to balance the output projection."""

    pipeline_parallel_layers_per_stage: int | None = None
    """Transformer layers per pipeline stage (None: one stage per pp rank, or per virtual stage)."""

    pipeline_parallel_split_points: list[str] = field(default_factory=list)
    """The older way to cut stages: the first layer of each stage after the first (e.g. ["layers.4", "layers.8"] gives 3 stages); the embedding goes with the first stage, norm and output with the last. Prefer module_fqns_per_model_part."""

    pipeline_parallel_schedule: str = "1F1B"
    """Pipeline schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV."""

    pipeline_parallel_schedule_csv: str | None = ""
    """CSV file with a custom pipeline action table (overrides pipeline_parallel_schedule)."""

    pipeline_parallel_microbatch_size: int = 1
    """Microbatch size for pipeline parallelism; local_batch_size / this = number of microbatches."""

    pipeline_parallel_microbatches: int | None = None
    """The older way to set the pipeline microbatch count (it must divide local_batch_size); None: local_batch_size / pipeline_parallel_microbatch_size. Prefer pipeline_parallel_microbatch_size."""

    context_parallel_degree: int = 1
    """Context parallelism degree (sequence sharded across ranks)."""

    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How ring attention exchanges key/value shards (causal attention; masked attention always all-gathers them)."""

    context_parallel_load_balancer: Literal["headtail", "none"] = "headtail"
    """How context parallel spreads causal attention's work over the cp ranks: headtail (each rank holds one chunk from the front and one from the back of every sequence; seq_len divisible by 2*cp) or none (contiguous chunks: later ranks attend to more keys; seq_len divisible by cp)."""

    expert_parallel_degree: int = 1
    """Expert parallelism degree (MoE models): experts spread over this many of the dp_shard x cp ranks, tokens sent to them by all-to-all."""

    expert_tensor_parallel_degree: int = 1
    """Tensor parallelism inside experts (MoE models): 1 keeps each expert whole on every TP rank; tensor_parallel_degree splits the routed and shared experts' hidden dims over the TP ranks."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save and load checkpoints."""

    folder: str = "checkpoint"
    """Folder (under dump_folder) for checkpoints: {folder}/step-N."""

    interval: int = 500
    """Save every this many steps."""

    initial_load_path: str | None = None
    """Checkpoint folder to initialise from when no checkpoint exists in folder yet."""

    initial_load_model_only: bool = True
    """Load only model weights from initial_load_path."""

    initial_load_in_hf: bool = False
    """initial_load_path holds HF safetensors weights."""

    last_save_model_only: bool = True
    """The final save holds only model weights (in export_dtype)."""

    last_save_in_hf: bool = False
    """Write the final save as HF safetensors."""

    export_dtype: Literal["float16", "bfloat16", "float32"] = "float32"
    """Dtype of model-only exports."""

    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Checkpoint saving: synchronous, async in a thread, or async with pinned-memory staging (CUDA)."""

    keep_latest_k: int = 10
    """Keep this many newest checkpoints, deleting older ones (0 keeps all)."""

    load_step: int = -1
    """Step to load (-1: the newest complete checkpoint)."""

    exclude_from_loading: list[str] = field(default_factory=list)
    """State keys not loaded on resume, e.g. optimizer,dataloader (comma separated)."""

    enable_first_step_checkpoint: bool = False
    """Also save right after step 1."""

    create_seed_checkpoint: bool = False
    """Write the initialised weights as step-0 and exit (run with every parallel degree 1)."""

    load_only: bool = False
    """Load checkpoints but never save any."""

    start_fresh: bool = False
    """Start from scratch although the folder holds checkpoints (e.g. ones that fail verification); they are left untouched: never loaded, purged or overwritten."""

    enable_ft_dataloader_checkpoints: bool = False
    """Upstream's per-replica-group dataloader checkpoints; not needed here (a warning): the data position is global, the same in every fault-tolerant replica group, and the shared checkpoint holds it."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective", "memory_budget"] = "selective"
    """Activation checkpointing: none, full (every block), selective, or memory_budget
    (torch.compile's partitioner recomputes what memory_budget asks; needs compile.enable)."""

    selective_ac_option: str = "2"
    """Selective AC: an integer N checkpoints every Nth block; 'op' uses the op-level save list."""

    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = field(
        default_factory=lambda: ["moe.router.gate"]
    )
    """Module FQNs whose matmuls are always recomputed under op-level SAC."""

    early_stop: bool = False
    """Stop recomputation early once the needed activations are rebuilt."""

    memory_budget: float = 0.5
    """memory_budget mode: activation memory the compiled blocks may keep, from 0.0 (recompute
    like full AC) to 1.0 (keep what compile keeps by default, the fastest)."""

    visualize_memory_budget_pareto: bool = False
    """memory_budget mode: write each compiled graph's recompute-runtime vs memory curve as SVG
    to {job.dump_folder}/memory_budget_pareto (needs matplotlib)."""

    preserve_rng_state: bool = False
    """Stash and restore RNG state around recomputation (bitwise-identical dropout etc.)."""

    determinism_check: Literal["default", "none"] = "default"
    """Determinism check torch.utils.checkpoint runs on recomputation (the only two it has)."""

    debug: bool = False
    """Capture AC debug information (slow)."""


@dataclass
class Compile:
    enable: bool = False
    """Apply torch.compile."""

    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: model and/or loss (comma separated)."""

    backend: str = "inductor"
    """torch.compile backend."""


@dataclass
class Float8:
    enable_fsdp_float8_all_gather: bool = False
    """All-gather float8 weights under FSDP (tensorwise scaling)."""

    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """Precompute float8 scales for FSDP all-gather once per step."""

    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = None
    """float8 recipe (None: tensorwise)."""

    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear modules whose FQN contains one of these are not converted (comma separated)."""

    emulate: bool = False
    """Emulate float8 matmuls (for testing on hardware without float8)."""

    moe_fqns_prototype: list[str] = field(default_factory=list)
    """MoE modules converted to float8 grouped GEMMs (prototype)."""


@dataclass
class MX:
    recipe_name: str = "mxfp8_rceil"
    """torchao MXFP8 recipe: mxfp8_rceil, mxfp8_rceil_wgrad_with_hp, mxfp8_emulated_rceil (any device; slow)."""

    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear modules whose FQN contains one of these are not converted (comma separated)."""

    moe_fqns_prototype: list[str] = field(default_factory=list)
    """MoE modules converted to MXFP8 grouped GEMMs (prototype)."""


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Collective timeout during initialisation and the first step."""

    train_timeout_seconds: int = 100
    """Collective timeout after the first training step."""

    trace_buf_size: int = 20000
    """Flight Recorder entries kept per rank (0 disables it)."""

    save_traces_folder: str = "comm_traces"
    """Folder (under dump_folder) for Flight Recorder dumps."""

    save_traces_file_prefix: str = "rank_"
    """File name prefix of Flight Recorder dumps."""


@dataclass
class MemoryEstimation:
    enable: bool = False
    """Estimate per-rank peak memory before training."""

    disable_fake_mode: bool = False
    """Estimate with real tensors instead of FakeTensorMode."""


@dataclass
class FaultTolerance:
    enable: bool = False
    """Train as one replica group of a fault-tolerant job (torchft): groups coordinate through the
    torchft lighthouse, a failed group is dropped from the quorum and rejoins from a live peer."""

    process_group: str = "gloo"
    """Process group between replica groups: gloo, or nccl (CUDA)."""

    process_group_timeout_ms: int = 10000
    """Timeout of the cross-group collectives, live-state transfers and commit votes."""

    replica_id: int = 0
    """This replica group's id, 0 .. group_size-1 (picks its share of the data)."""

    group_size: int = 0
    """Number of replica groups in the job (0: refused when enable is set)."""

    min_replica_size: int = 1
    """A step commits only when at least this many groups took part in it."""

    semi_sync_method: str | None = None
    """Semi-synchronous training across groups: local_sgd or diloco (default: synchronous)."""

    lighthouse: str = ""
    """torchft lighthouse address, e.g. http://host:29510 (default: $TORCHFT_LIGHTHOUSE)."""

    quorum_timeout_seconds: int = 60
    """How long a group waits for a quorum before giving up with an error."""

    startup_wait_seconds: int = 60
    """Before its first step a group waits up to this long for all group_size groups to be in
    its quorum (0: start with the groups that are up; later ones catch up by healing)."""

    sync_steps: int = 5
    """local_sgd / diloco: optimizer steps between two synchronisations of the groups."""

    num_fragments: int = 1
    """diloco: split the model into this many fragments that synchronise in turn (streaming
    DiLoCo): one every sync_steps / num_fragments steps, each every sync_steps steps. Layers are
    spread evenly, the embedding with the first fragment, the norm and output with the last."""

    module_fqns_per_model_fragment: list[list[str]] = field(default_factory=list)
    """diloco: the modules of each fragment, e.g. [["tok_embeddings", "layers.0"], ["layers.1",
    "norm", "output"]] (instead of num_fragments' even split)."""

    fragment_sync_delay: int = 0
    """diloco: steps between starting a fragment's synchronisation and waiting for it."""

    fragment_update_alpha: float = 0.0
    """diloco: weight of the local parameters when merging them with the global ones."""

    outer_lr: float = 0.7
    """diloco: learning rate of the outer (Nesterov SGD) optimizer."""

    outer_momentum: float = 0.9
    """diloco: momentum of the outer optimizer."""


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
