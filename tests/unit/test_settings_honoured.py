"""Settings that some layout would accept and then not use are refused or made to act.

Refusals go through ``python -m torchtitan.config_manager`` in-process (the pre-flight the
launcher runs): one ``error:`` line, exit code 2.
"""

from __future__ import annotations

import pytest

from tests.conftest import REPO_ROOT
from torchtitan.config.manager import main

DEBUG = str(REPO_ROOT / "train_configs" / "debug_model.toml")
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--world_size", "2")


def refusal(capsys, *flags: str) -> str:
    """The one ``error:`` line the pre-flight prints for ``flags`` (exit code 2)."""
    code = main(["--job.config_file", DEBUG, *flags])
    out = capsys.readouterr()
    assert (code, out.out) == (2, ""), out.err
    assert len(out.err.splitlines()) == 1 and out.err.startswith("error: "), out.err
    return out.err


def accepted(capsys, *flags: str) -> None:
    code = main(["--job.config_file", DEBUG, *flags])
    assert code == 0, capsys.readouterr().err


# --- pipeline: a setting the chosen cut or schedule does not use -----------------------------
@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--parallelism.pipeline_parallel_split_points", "layers.3",
          "--parallelism.pipeline_parallel_first_stage_less_layers", "0"],
         "parallelism.pipeline_parallel_first_stage_less_layers=0 is not used: "
         "parallelism.pipeline_parallel_split_points lists each stage's modules; drop it"),
        (["--parallelism.module_fqns_per_model_part",
          "tok_embeddings,layers.0,layers.1,layers.2;layers.3,layers.4,layers.5,norm,output",
          "--parallelism.pipeline_parallel_last_stage_less_layers", "2"],
         "parallelism.pipeline_parallel_last_stage_less_layers=2 is not used: "
         "parallelism.module_fqns_per_model_part lists each stage's modules"),
    ],
)
def test_stage_size_offsets_beside_listed_stages_are_refused(capsys, flags, needle):
    assert needle in refusal(capsys, *PP2, *flags)


def test_listed_stages_with_default_offsets_are_accepted(capsys):
    accepted(capsys, *PP2, "--parallelism.pipeline_parallel_split_points", "layers.3")


def test_a_named_schedule_beside_a_csv_schedule_is_refused(capsys, tmp_path):
    path = tmp_path / "sched.csv"
    path.write_text("0F0,0B0\n1F0,1B0\n")
    csv = ("--parallelism.pipeline_parallel_schedule_csv", str(path))
    message = refusal(capsys, *PP2, *csv, "--parallelism.pipeline_parallel_schedule", "GPipe")
    assert "parallelism.pipeline_parallel_schedule='GPipe' is not used: " \
           "pipeline_parallel_schedule_csv gives the schedule; drop one of them" in message


# --- optimizer: a resumed run uses this config's hyperparameters -----------------------------
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_resume_uses_this_configs_optimizer_settings(caplog, state_dtype):
    """A checkpoint's param groups hold betas, eps, weight decay and AdamW-vs-Adam; loading it
    used to put them in place of this config's without a word."""
    import copy

    import torch
    from torch import nn

    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config.job_config import Optimizer

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    saved = OptimizersContainer([model], Optimizer(name="AdamW", state_dtype=state_dtype))
    model(torch.randn(2, 4)).sum().backward()
    saved.step()
    new = Optimizer(name="Adam", beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.0,
                    state_dtype=state_dtype)
    fresh = copy.deepcopy(model)  # a resumed run's model: no gradients yet
    fresh.zero_grad(set_to_none=True)
    resumed = OptimizersContainer([fresh], new)
    resumed.load_state_dict(saved.state_dict())
    for group in resumed.param_groups:
        assert group["betas"] == (0.8, 0.9) and group["eps"] == 1e-6
        assert group["weight_decay"] == 0.0 and group["decoupled_weight_decay"] is False
    assert resumed.optimizers[0].state[fresh.weight]["exp_avg"].abs().sum() > 0  # state loaded
    assert "the optimizer uses this config's settings, not the checkpoint's: betas (0.9, 0.95) " \
           "-> (0.8, 0.9), eps 1e-08 -> 1e-06, weight_decay 0.1 -> 0.0" in caplog.text


# --- job.description: logged at start, as its help says --------------------------------------
def test_job_description_is_logged_by_rank_zero(caplog):
    import logging

    from torchtitan.build import log_resolved_config
    from torchtitan.config.job_config import JobConfig

    cfg = JobConfig()
    cfg.job.description = "ablation 7: no weight decay"
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        log_resolved_config(cfg, rank=1)
        assert "ablation 7" not in caplog.text
        log_resolved_config(cfg, rank=0)
    assert "Job: ablation 7: no weight decay" in caplog.text


# --- validation.enable with a frequency no step reaches --------------------------------------
@pytest.mark.parametrize(("freq", "warned"), [(50, True), (10, False)])
def test_validation_that_no_step_reaches_is_warned(caplog, freq, warned):
    from types import SimpleNamespace

    from torchtitan.components.validate import build_validator
    from torchtitan.config.job_config import JobConfig

    cfg = JobConfig()
    cfg.training.steps, cfg.validation.enable, cfg.validation.freq = 10, True, freq
    dims = SimpleNamespace(mesh_local_rank=lambda _: 0)
    run = SimpleNamespace(job_config=cfg, parallel_dims=dims, pipeline=None, model_parts=[None],
                          loss_fn=None, device="cpu", loss_mesh=None, weight_copies=None,
                          build_dataloader=lambda *args, **kw: [])
    build_validator(run)
    line = "validation.freq=50 > training.steps=10: the training loop validates at no step"
    assert (line in caplog.text) is warned


# --- an upstream flag this build refuses: the error alone, no "is ignored" line before it ---
def test_refused_upstream_flag_prints_only_the_error(capsys, caplog):
    message = refusal(capsys, "--parallelism.expert_parallel_comm_backend", "deepep")
    assert "parallelism.expert_parallel_comm_backend='deepep' is not built in" in message
    assert "is ignored" not in caplog.text
    accepted(capsys, "--parallelism.expert_parallel_comm_backend", "standard")
    # upstream's default is still dropped with its warning
    assert "obsolete flag --parallelism.expert_parallel_comm_backend is ignored" in caplog.text


# --- profiling with a profile_freq that no step of the run reaches ---------------------------
def _trace_steps(tmp_path, cfg, start: int, last: int, last_step: int | None) -> list[str]:
    """Run the profiler over steps ``start + 1 .. last``; the ``iteration_N`` folders written."""
    import torch

    from torchtitan.tools.profiling import maybe_enable_profiling

    with maybe_enable_profiling(cfg, str(tmp_path), global_step=start, last_step=last_step,
                                rank=0) as prof:
        for _ in range(start, last):
            torch.ones(2).sum()
            if prof is not None:
                prof.step()
    root = tmp_path / cfg.save_traces_folder
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


@pytest.mark.parametrize(
    ("freq", "warmup", "active", "start", "last"),
    [(50, 3, 1, 0, 10), (10, 3, 1, 0, 9), (10, 3, 1, 0, 10), (10, 3, 1, 10, 19),
     (10, 3, 1, 9, 10), (10, 3, 1, 15, 20), (4, 0, 4, 5, 7), (4, 0, 4, 5, 8)],
)
def test_profiling_that_writes_no_trace_is_warned(caplog, tmp_path, freq, warmup, active, start,
                                                  last):
    from torchtitan.config.job_config import Profiling

    cfg = Profiling(enable_profiling=True, profile_freq=freq, profiler_warmup=warmup,
                    profiler_active=active)
    written = _trace_steps(tmp_path / "unchecked", cfg, start, last, last_step=None)
    caplog.clear()
    checked = _trace_steps(tmp_path / "checked", cfg, start, last, last_step=last)
    warned = "profiling.enable_profiling writes no trace: " in caplog.text
    assert warned == (written == []), (written, caplog.text)
    assert checked == written
    if (freq, start) == (50, 0):
        assert "profiling.profile_freq=50 > training.steps=10; lower --profiling.profile_freq" \
            in caplog.text
    if (freq, start, last) == (10, 10, 19):
        assert "this run does steps 11..19 and none is a multiple of profiling.profile_freq=10" \
            in caplog.text


@pytest.mark.parametrize(("freq", "warned"), [(50, True), (10, False)])
def test_memory_snapshot_that_no_step_reaches_is_warned(caplog, monkeypatch, tmp_path, freq,
                                                        warned):
    import torch

    from torchtitan.config.job_config import Profiling
    from torchtitan.tools.profiling import maybe_enable_memory_snapshot

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: None)
    cfg = Profiling(enable_memory_snapshot=True, profile_freq=freq)
    with maybe_enable_memory_snapshot(cfg, str(tmp_path), global_step=0, last_step=10,
                                      rank=0) as mem:
        assert mem is not None  # still recording: an out-of-memory error writes its snapshot
    line = ("profiling.enable_memory_snapshot writes a snapshot only on out-of-memory: "
            "profiling.profile_freq=50 > training.steps=10")
    assert (line in caplog.text) is warned


# --- comm.trace_buf_size beside an exported TORCH_FR_BUFFER_SIZE -----------------------------
@pytest.mark.parametrize(
    ("name", "exported", "warned"),
    [("TORCH_FR_BUFFER_SIZE", "5000", True), ("TORCH_NCCL_TRACE_BUFFER_SIZE", "0", True),
     ("TORCH_FR_BUFFER_SIZE", "64", False)],
)
def test_trace_buf_size_wins_over_the_environment(caplog, monkeypatch, tmp_path, name, exported,
                                                  warned):
    import os

    from torchtitan.config.job_config import JobConfig
    from torchtitan.tools.flight_recorder import configure_env

    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "RANK")}
    monkeypatch.setattr(os, "environ", {**env, name: exported})  # nothing leaks to other tests
    comm = JobConfig().comm
    comm.trace_buf_size = 64
    configure_env(comm, str(tmp_path), "cpu")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "64"
    line = (f"{name}={exported} from the environment is overridden by comm.trace_buf_size=64: "
            f"Flight Recorder keeps 64 entries per rank; to keep the exported size pass "
            f"--comm.trace_buf_size {exported}")
    assert (line in caplog.text) is warned


@pytest.mark.parametrize("exported", [None, "/elsewhere/nccl_trace_rank_"])
def test_an_exported_nccl_dump_path_is_kept_and_said(caplog, monkeypatch, tmp_path, exported):
    """NCCL's own timeout dumps follow TORCH_NCCL_DEBUG_INFO_TEMP_FILE; an exported one is left
    alone (the config cannot say "unset"), with one warning saying where dumps go."""
    import os

    from torchtitan.config.job_config import JobConfig
    from torchtitan.tools.flight_recorder import configure_env

    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCH_NCCL_") and k != "RANK"}
    if exported is not None:
        env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = exported
    monkeypatch.setattr(os, "environ", env)  # nothing leaks to other tests
    comm = JobConfig().comm
    configure_env(comm, str(tmp_path), "cuda")
    ours = os.path.join(str(tmp_path), comm.save_traces_folder, comm.save_traces_file_prefix)
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == (exported or ours)
    said = f"TORCH_NCCL_DEBUG_INFO_TEMP_FILE={exported} from the environment: NCCL's watchdog"
    assert (said in caplog.text) is (exported is not None)


# --- compile.enable with nothing to compile --------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "needle"),
    [(["--compile.enable", "--compile.components", ""],
      "error: compile.enable compiles nothing: compile.components is empty; name what to "
      "compile (--compile.components model,loss) or drop --compile.enable"),
     (["--compile.enable", "--compile.components", "modle"],
      "error: compile.components has unknown entries ['modle']; use any of ['model', 'loss']")],
)
def test_compile_that_compiles_nothing_is_refused(capsys, flags, needle):
    assert refusal(capsys, *flags).strip() == needle


@pytest.mark.parametrize("flags", [["--compile.enable", "--compile.components", "loss"],
                                   ["--compile.components", ""]])
def test_compile_of_something_or_compile_off_is_accepted(capsys, flags):
    accepted(capsys, *flags)
