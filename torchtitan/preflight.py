"""Pre-flight: everything a run's config can be checked for before any rank starts.

``check_run(cfg, world_size)`` is the plan of the run (:func:`torchtitan.plan.plan_run`, the
checks the ranks' build runs: planned-but-unbuilt settings, the parallel layout against the
world size, batch arithmetic, the model flavor and its shape against the layout, context and
expert parallel rules, the pipeline plan on a ``meta`` model) plus what depends on this
machine: compile and device-only features (async TP, converters), and where the run starts: the dump folder, the tokenizer file, the datasets
(known names, local files with documents, a streaming Hub dataset's reachability) and what the
checkpoint settings load. It raises the trainer's own one-line errors (``ConfigError``,
``ParallelismError``, ``ValueError``, ``FileNotFoundError``).

``run_train.sh`` runs it through :mod:`torchtitan.launch` before torchrun starts, and
``python -m torchtitan.config_manager`` (``--check``) runs it before printing a config.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import TYPE_CHECKING, Any

from torchtitan.config.job_config import JobConfig, Parallelism
from torchtitan.config.planned import reject_planned_settings
from torchtitan.tools.logging import logger, logger_level

if TYPE_CHECKING:
    from torchtitan.distributed.parallel_dims import ParallelDims

__all__ = [
    "USER_ERRORS",
    "check_dump_folder",
    "check_output_folders",
    "check_run",
    "default_world_size",
    "summary",
]

USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,  # ConfigError, ParallelismError and CheckpointError are ValueErrors
    FileNotFoundError,
    ImportError,
)
"""What a bad config or a missing file raises: one line for people, exit code 2."""


def default_world_size(parallelism: Parallelism) -> int:
    """The world size the degrees ask for (``data_parallel_shard_degree=-1`` counts as 1)."""
    p = parallelism
    shard = max(p.data_parallel_shard_degree, 1)
    return (
        p.data_parallel_replicate_degree
        * shard
        * p.context_parallel_degree
        * p.tensor_parallel_degree
        * p.pipeline_parallel_degree
    )


def _check_components(cfg: JobConfig, device_type: str) -> None:
    from torchtitan.distributed.compile import model_compile_enabled
    from torchtitan.distributed.tensor_parallel import check_async_tp

    compiled = model_compile_enabled(cfg.compile)
    if cfg.parallelism.enable_async_tensor_parallel:
        check_async_tp(compiled, device_type)
    from torchtitan.components.converters import check_converters

    check_converters(cfg, device_type)  # float8 / mx: hardware or emulation
    from torchtitan.distributed.activation_checkpoint import check_memory_budget_plots

    check_memory_budget_plots(cfg.activation_checkpoint)


def check_dump_folder(path: str) -> None:
    """``job.dump_folder`` is a folder this process can write in, or one it can create;
    ``ValueError`` naming it otherwise. Creates nothing (the probe is an unnamed temporary
    file). The pre-flight and every rank (``MetricsProcessor``) run it."""
    if not path.strip():  # os.path.join("", x) would write everything into the working folder
        raise ValueError(
            "job.dump_folder is empty: give the folder for the run's outputs (default ./outputs; "
            "'.' for the working folder)"
        )
    _check_folder(path, "job.dump_folder", "use another --job.dump_folder")


def _check_folder(path: str, key: str, fix: str) -> None:
    folder = os.path.abspath(os.path.expanduser(path))
    existing = folder
    while not os.path.exists(existing):  # the nearest folder that is there
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == folder else f"cannot be created: {existing} is a file"
        raise ValueError(f"{key}={path} {where}, not a folder: {fix}")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        why = err.strerror or type(err).__name__
        where = "is not writable" if existing == folder else f"cannot be created in {existing}"
        raise ValueError(f"{key}={path} {where} ({why}): fix the permissions or {fix}") from None


def output_folders(cfg: JobConfig) -> list[tuple[str, str]]:
    """``(key, path)`` of the folders under ``job.dump_folder`` the enabled features write."""
    dump = cfg.job.dump_folder
    folders = []
    if cfg.metrics.enable_tensorboard:
        folders.append(("metrics.save_tb_folder", cfg.metrics.save_tb_folder))
    if cfg.profiling.enable_profiling:
        folders.append(("profiling.save_traces_folder", cfg.profiling.save_traces_folder))
    if cfg.profiling.enable_memory_snapshot:
        folders.append(
            ("profiling.save_memory_snapshot_folder", cfg.profiling.save_memory_snapshot_folder)
        )
    if cfg.comm.trace_buf_size > 0:  # Flight Recorder's dumps when a collective stalls
        folders.append(("comm.save_traces_folder", cfg.comm.save_traces_folder))
    return [(key, os.path.join(dump, sub)) for key, sub in folders]


def check_output_folders(cfg: JobConfig) -> None:
    """:func:`check_dump_folder`, then each folder an enabled feature writes under it
    (TensorBoard, profiler traces, memory snapshots, Flight Recorder dumps): a file there would
    fail the run at its first write (the profiler's at a trace's end, in C++, without a
    message; Flight Recorder's when a stall is to be diagnosed)."""
    check_dump_folder(cfg.job.dump_folder)
    for key, path in output_folders(cfg):
        _check_folder(path, key, f"set --{key} to a folder name (under job.dump_folder)")


def _dataset_sections(cfg: JobConfig) -> list[tuple[str, Any]]:
    sections = [("training", cfg.training)]
    if cfg.validation.enable:
        sections.append(("validation", cfg.validation))
    return sections


def _check_files(cfg: JobConfig) -> None:
    """The dump folder, the tokenizer's file and a local dataset path (a dry run needs none)."""
    check_output_folders(cfg)
    from torchtitan.components.tokenizer import check_tokenizer_file

    check_tokenizer_file(cfg.model)
    for key, path in (
        ("training.dataset_path", cfg.training.dataset_path),
        ("validation.dataset_path", cfg.validation.dataset_path if cfg.validation.enable else None),
    ):
        if path and not os.path.exists(os.path.expanduser(path)):
            raise FileNotFoundError(f"{key}={path!r} does not exist: fix --{key}")
    from torchtitan.datasets.mix import parse_dataset_spec

    for name, section in _dataset_sections(cfg):  # a mix's own NAME=PATH entries
        key = f"{name}.dataset"
        for source in parse_dataset_spec(section.dataset, section.dataset_path, key):
            if source.path and section.dataset_path is None and not os.path.exists(
                os.path.expanduser(source.path)
            ):
                raise FileNotFoundError(f"{key}: {source.name}={source.path} does not exist")


def _check_datasets(cfg: JobConfig) -> None:
    """Each source as the dataloader resolves it: a known name, local files with documents,
    a streaming Hub dataset that can be reached (after ``custom_import``: it may register)."""
    from torchtitan.datasets.mix import parse_dataset_spec
    from torchtitan.datasets.sources import check_source, in_section, resolve_dataset

    for name, section in _dataset_sections(cfg):
        key = f"{name}.dataset"
        for source in parse_dataset_spec(section.dataset, section.dataset_path, key):
            try:
                check_source(resolve_dataset(source.name, source.path), source.name)
            except FileNotFoundError as err:
                raise FileNotFoundError(in_section(err, name)) from None


def _check_checkpoint(cfg: JobConfig, on_this_machine: bool) -> None:
    """``exclude_from_loading`` names and, on this machine, what the first
    ``CheckpointManager.load`` plans: ``initial_load_path`` present and a checkpoint,
    ``load_step`` there, not a folder of damaged checkpoints only."""
    from torchtitan.components.checkpoint.common import (
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        TRAIN_STATE,
    )
    from torchtitan.components.checkpoint.load_plan import check_seed_folder, plan_load
    from torchtitan.components.checkpoint.manager import parse_exclude

    ck = cfg.checkpoint
    # What the Trainer's CheckpointManager holds: the model and the states it is handed.
    parse_exclude(ck.exclude_from_loading, [MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE])
    folder = os.path.join(cfg.job.dump_folder, ck.folder)
    if on_this_machine and ck.create_seed_checkpoint:
        check_seed_folder(folder)
    if not on_this_machine or ck.create_seed_checkpoint or not (ck.enable or ck.initial_load_path):
        return
    plan_load(folder, ck.load_step, ck, resume=ck.enable)


def check_run(cfg: JobConfig, world_size: int | None, *, on_this_machine: bool = True,
              device_type: str | None = None) -> ParallelDims:
    """Check ``cfg`` for a run on ``world_size`` ranks; returns the resolved degrees.

    ``world_size`` None (an elastic job: known at run time) checks the layout at the world
    size the degrees ask for (:func:`default_world_size`).

    ``on_this_machine`` adds what depends on where the run starts: device-only features
    (on ``device_type``, default this machine's), the dump folder, the tokenizer file, the
    datasets and the checkpoint the run would load. Leave it
    off for a dry run (COMM_MODE switches device features off and needs no files) or to check
    a config for another machine. Raises one of :data:`USER_ERRORS` with one line.
    """
    with logger_level(logger, logging.ERROR):  # the ranks print the info/warning lines
        reject_planned_settings(cfg)
        if on_this_machine:  # torch-free, so a missing file is reported in a blink
            _check_files(cfg)
        # The rest needs torch (imported here, so the checks above stay fast).
        from torchtitan.plan import plan_run

        if on_this_machine and device_type is None:
            from torchtitan.tools.device import device_type as detected

            device_type = detected
        device_type = device_type if on_this_machine else None
        parallel_dims = plan_run(cfg, world_size or default_world_size(cfg.parallelism),
                                 device_type=device_type).parallel_dims
        if on_this_machine:
            _check_components(cfg, device_type)
            from torchtitan.components.fault_tolerance.layout import check_lighthouse

            check_lighthouse(cfg.fault_tolerance)
            _check_datasets(cfg)
        _check_checkpoint(cfg, on_this_machine)
    return parallel_dims


def summary(cfg: JobConfig, parallel_dims: ParallelDims) -> str:
    """One line naming what was checked, e.g. for ``config_manager --check``."""
    d = parallel_dims
    dims = ", ".join(
        f"{name} {getattr(d, name)}"
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
        if getattr(d, name) > 1
    ) or "one rank"
    return (
        f"ok: {cfg.model.name} {cfg.model.flavor} on {d.world_size} rank(s) ({dims}), "
        f"{cfg.training.steps} steps"
    )
