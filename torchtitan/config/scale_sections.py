"""JobConfig sections about scaling a run out: parallelism and fault tolerance, checkpoints,
activation checkpointing, compile, low-precision converters, communication and memory
estimation (the rest of the schema, and ``JobConfig`` itself, are in ``job_config.py``).

Each field's docstring (the string literal under it) is its ``--help`` text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


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
    """Expert parallelism degree (MoE models): experts spread over this many of the ranks with different tokens (dp_shard x cp, and first the tensor_parallel_degree / expert_tensor_parallel_degree token groups of the TP ranks), tokens sent to them by all-to-all."""

    expert_tensor_parallel_degree: int = 1
    """Tensor parallelism inside experts (MoE models), a divisor of tensor_parallel_degree: 1 lets each TP rank route its own tokens with whole experts (ep may then include the TP ranks); tensor_parallel_degree gathers the sequence and splits the routed and shared experts' hidden dims over the TP ranks; a value between splits the TP ranks into tp/etp groups that route their own tokens, each expert split over a group's etp ranks."""


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

    last_save_in_hf_allow_lossy: bool = False
    """last_save_in_hf also when HF's format drops part of the model (a trained MoE routing bias), with one warning."""

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

    weight_grad_views: bool = True
    """Where training.weight_copies=auto applies: float8 linears keep their weight
    gradients in bf16 through views of their own weights (no memory, no widening pass; the
    plain path's numbers). --float8.no_weight_grad_views: torchao's float32 gradients."""


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

    should_quantize: bool = False
    """diloco: all-reduce the pseudo-gradients in float8 (torchft's quantized all-reduce, about a
    quarter of the fp32 bytes between groups); needs CUDA, triton and process_group nccl."""
