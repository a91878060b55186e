"""The pre-flight check (torchtitan/preflight.py), the config tool that runs it, and the
launcher's failure summary (torchtitan/launch.py), all in-process."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.conftest import REPO_ROOT
from torchtitan.config.manager import ConfigManager, main
from torchtitan.launch import (
    TRAINER_MARK,
    _trainer_args,
    _world_size,
    record_error,
    summarize_failure,
)
from torchtitan.preflight import check_run, default_world_size

DEBUG = str(REPO_ROOT / "train_configs" / "debug_model.toml")


def cfg_of(*flags: str):
    return ConfigManager().parse_args(["--job.config_file", DEBUG, *flags])


def tool(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["--job.config_file", DEBUG, *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# --- the config tool validates fully ----------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--activation_checkpoint.determinism_check", "strict"], "expected one of 'default'"),
        (["--optimizer.early_step_in_backward"], "early_step_in_backward does not work here: "
         "training.max_norm=1.0 clips by the global grad norm"),
        (["--optimizer.early_step_in_backward", "--training.max_norm", "0",
          "--parallelism.data_parallel_replicate_degree", "2", "--world_size", "2"],
         "DDP all-reduces gradients in buckets after the hooks fire; use FSDP or HSDP"),
        (["--optimizer.early_step_in_backward", "--training.max_norm", "0",
          "--parallelism.pipeline_parallel_degree", "2", "--world_size", "2"],
         "pipeline parallel runs backward per pipeline microbatch inside its schedule"),
        (["--optimizer.early_step_in_backward", "--training.max_norm", "0",
          "--model.name", "qwen3", "--model.flavor", "debugmodel_moe",
          "--parallelism.tensor_parallel_degree", "2", "--world_size", "2"],
         "under tensor parallel the MoE layers sum their router and expert gradients over the "
         "TP ranks after backward"),
        (["--parallelism.expert_parallel_degree", "2", "--world_size", "2"],
         "needs a mixture-of-experts model; llama3 debugmodel has no experts"),
        (["--parallelism.expert_tensor_parallel_degree", "2", "--world_size", "2"],
         "expert_tensor_parallel_degree=2 needs tensor parallel (it splits each expert over TP "
         "ranks): set parallelism.tensor_parallel_degree to a multiple of 2, or leave "
         "expert_tensor_parallel_degree at 1"),
        (["--parallelism.expert_tensor_parallel_degree", "2", "--parallelism.tensor_parallel_degree",
          "2", "--world_size", "2"],
         "expert_tensor_parallel_degree=2 needs a mixture-of-experts model; llama3 debugmodel "
         "has no experts"),
        (["--parallelism.tensor_parallel_degree", "3", "--world_size", "8"], "world size 8"),
        (["--parallelism.tensor_parallel_degree", "32"], "must divide the model's n_heads=16"),
        (["--training.global_batch_size", "12"], "global_batch_size=12 must be a multiple"),
        (["--model.flavor", "8b"], "Did you mean '8B'"),
        (["--activation_checkpoint.debug", "--compile.enable"], "debug records the ops of eager"),
        (["--validation.enable", "--validation.seq_len", "1024"],
         "validation.seq_len=1024 is longer than the model's max_seq_len=512 (set from "
         "training.seq_len): set --validation.seq_len 512 or less"),
    ],
)
def test_tool_refuses_a_config_the_trainer_would_refuse(capsys, flags, needle):
    code, out, err = tool(capsys, *flags)
    assert (code, out) == (2, "")
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and needle in err, err


def test_tool_world_size_defaults_to_ngpu(capsys, monkeypatch):
    monkeypatch.setenv("NGPU", "3")
    code, _, err = tool(capsys, "--check")
    assert code == 0 and err == ""
    assert capsys.readouterr().out == ""  # (already read by tool)
    monkeypatch.setenv("NGPU", "2")
    code, out, _ = tool(capsys, "--check", "--parallelism.tensor_parallel_degree", "4")
    assert code == 2 and out == ""


def test_check_prints_one_ok_line(capsys, monkeypatch):
    monkeypatch.delenv("COMM_MODE", raising=False)
    code, out, err = tool(capsys, "--check", "--world_size", "4",
                          "--parallelism.tensor_parallel_degree", "2")
    assert (code, err) == (0, "")
    assert out == "ok: llama3 debugmodel on 4 rank(s) (dp_shard 2, tp 2), 30 steps\n"


def test_check_needs_the_tokenizer_printing_does_not(capsys, monkeypatch):
    monkeypatch.delenv("COMM_MODE", raising=False)
    missing = ("--model.hf_assets_path", "./assets/hf/Llama-3.1-8B")
    code, out, _ = tool(capsys, *missing)
    assert code == 0 and "hf_assets_path = \"./assets/hf/Llama-3.1-8B\"" in out
    code, out, err = tool(capsys, "--check", *missing)
    assert (code, out) == (2, "")
    assert "hf download meta-llama/Llama-3.1-8B --include '*tokenizer*' --local-dir " in err
    monkeypatch.setenv("COMM_MODE", "fake_backend")  # a dry run needs no tokenizer
    assert tool(capsys, "--check", *missing)[0] == 0


def test_bad_world_size_flag(capsys):
    code, _, err = tool(capsys, "--world_size", "zero")
    assert code == 2 and "--world_size expects a positive integer, got 'zero'" in err


# --- check_run ----------------------------------------------------------------------------------
def test_pipeline_plan_is_checked_without_building_the_model():
    cfg = cfg_of("--parallelism.pipeline_parallel_degree", "2",
                 "--parallelism.pipeline_parallel_schedule", "1F1B",
                 "--parallelism.pipeline_parallel_microbatch_size", "8")
    with pytest.raises(ValueError, match="1F1B needs at least as many microbatches as stages"):
        check_run(cfg, 2, on_this_machine=False)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"])
def test_zero_bubble_schedules_refuse_compiled_blocks(schedule):
    """torch's split-backward schedules do not run compiled stages (with block AC the compiled
    block hides inside its wrapper and the run died in backward with 'donated buffers')."""
    flags = ("--parallelism.pipeline_parallel_degree", "2",
             "--parallelism.pipeline_parallel_schedule", schedule,
             "--training.local_batch_size", "8")
    with pytest.raises(ValueError, match=f"schedule={schedule} splits each backward in two"):
        check_run(cfg_of(*flags, "--compile.enable"), 2, on_this_machine=False)
    check_run(cfg_of(*flags), 2, on_this_machine=False)
    check_run(cfg_of(*flags, "--compile.enable", "--compile.components", "loss"), 2,
              on_this_machine=False)
    # op-level SAC allows one backward per block; these schedules run two
    op_sac = ("--activation_checkpoint.mode", "selective",
              "--activation_checkpoint.selective_ac_option", "op")
    with pytest.raises(ValueError, match="op-level selective activation checkpointing allows one"):
        check_run(cfg_of(*flags, *op_sac), 2, on_this_machine=False)
    check_run(cfg_of(*flags, "--activation_checkpoint.mode", "full"), 2, on_this_machine=False)


def test_async_tp_policy_refused_on_cpu_only():
    cfg = cfg_of("--parallelism.tensor_parallel_degree", "2", "--compile.enable",
                 "--parallelism.enable_async_tensor_parallel")
    with pytest.raises(ValueError, match="needs CUDA GPUs"):
        check_run(cfg, 2, device_type="cpu")
    check_run(cfg, 2, device_type="cuda")
    check_run(cfg, 2, on_this_machine=False)  # dry runs switch it off instead


def test_default_world_size_is_the_product_of_the_degrees():
    assert default_world_size(cfg_of().parallelism) == 1
    cfg = cfg_of("--parallelism.data_parallel_shard_degree", "2",
                 "--parallelism.tensor_parallel_degree", "4")
    assert default_world_size(cfg.parallelism) == 8
    assert check_run(cfg, None, on_this_machine=False).world_size == 8


# --- the launcher -----------------------------------------------------------------------------
def test_launcher_finds_the_trainer_and_the_world_size():
    assert _trainer_args(["-m", "torchtitan.train", "--x.y", "1"]) == ["--x.y", "1"]
    assert _trainer_args([str(REPO_ROOT / "train.py"), "--a"]) == ["--a"]
    assert _trainer_args(["-m", "tests.integration.assets.dist_probe"]) is None
    assert _world_size(["--nproc_per_node=4", "--nnodes", "2"]) == 8
    assert _world_size(["--nproc-per-node", "gpu"]) is None
    assert _world_size(["--nnodes=1:4"]) is None


def _failure(local_rank, message, *, mark=None, exitcode=2, timestamp=0):
    data = {} if mark is None else {TRAINER_MARK: {"exitcode": exitcode, "time": mark}}
    return SimpleNamespace(local_rank=local_rank, message=message, error_file_data=data,
                           exitcode=exitcode, timestamp=timestamp,
                           signal_name=lambda: "SIGTERM")


def test_summary_names_the_first_reported_error_once(capsys):
    failures = {
        0: _failure(0, "Signal 15 (SIGTERM) received by PID 1", exitcode=-15, timestamp=5),
        1: _failure(1, "rank 1 cannot read its shard", mark=10.0),
    }
    assert summarize_failure(failures, {0}, "/logs") == 2
    assert capsys.readouterr().err == (
        "error: rank 1 cannot read its shard (rank 1; every rank's output: /logs)\n"
    )
    failures[0] = _failure(0, "rank 1 cannot read its shard", mark=10.5)  # rank 0 said it too
    assert summarize_failure(failures, {0}, "/logs") == 2
    assert capsys.readouterr().err == ""  # the console showed rank 0's line already


def test_summary_of_a_crash_without_a_report(capsys):
    failures = {1: _failure(1, "", exitcode=-9, timestamp=3)}
    assert summarize_failure(failures, {0}, "/logs") == 137
    assert capsys.readouterr().err == "error: rank 1 failed (killed by signal SIGTERM); its output: /logs\n"


def test_summary_of_a_rank_that_failed_without_a_report_quotes_its_last_line(tmp_path, capsys):
    """A TRAIN_FILE script failing on rank 1 (hidden by LOG_RANK): the summary said only
    "exit code 1" and the top log folder."""
    log = tmp_path / "run_x" / "attempt_0" / "1" / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_text("[rank1]: Traceback (most recent call last):\n[rank1]:   File x\n"
                   "[rank1]: ValueError: rank one has no data shard here\n\n")
    failures = {1: _failure(1, "", exitcode=1, timestamp=3)}
    assert summarize_failure(failures, {0}, str(tmp_path)) == 1
    assert capsys.readouterr().err == (
        "error: rank 1 failed (exit code 1): ValueError: rank one has no data shard here; its "
        f"output: {log}\n")


def test_record_error_writes_torchruns_error_file(tmp_path, monkeypatch):
    path = tmp_path / "attempt_0" / "1" / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    record_error("bad thing", 2)
    data = json.loads(path.read_text())
    assert data["message"] == "bad thing" and data[TRAINER_MARK]["exitcode"] == 2



def test_context_parallel_rules_are_the_builds():
    cfg = cfg_of("--parallelism.context_parallel_degree", "2", "--validation.enable",
                 "--validation.seq_len", "256")
    with pytest.raises(ValueError, match="validation.seq_len=256 must equal training.seq_len=512"):
        check_run(cfg, 2, on_this_machine=False)
    assert check_run(cfg_of("--parallelism.context_parallel_degree", "2"), 2,
                     on_this_machine=False).cp == 2


@pytest.mark.parametrize(
    "raised",
    [RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                  "memory: you tried to allocate 6442450944 bytes. Error code 12"),
     "cuda"],
)
def test_out_of_memory_is_one_line_and_exit_2(monkeypatch, caplog, tmp_path, raised):
    import torch

    import torchtitan.train as train

    if raised == "cuda":
        raised = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def trainer(cfg):
        raise raised

    monkeypatch.setattr(train, "Trainer", trainer)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert train.main(["--job.config_file", DEBUG]) == 2  # a config too big: bad input
    errors = [m for m in caplog.messages if m.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: out of memory (")
    assert "lower training.local_batch_size" in errors[0]
    # the command that predicts this config's peak, with the run's own flags and ranks
    assert errors[0].endswith(f"`python scripts/estimate_memory.py --world-size 1 --job.config_file "
                              f"{DEBUG}` shows this config's peak per rank by part")
    assert json.loads((tmp_path / "error.json").read_text())[TRAINER_MARK]["exitcode"] == 2


@pytest.mark.parametrize(
    "name", ["debug_model", "deepseek_v3_debugmodel", "qwen3_debugmodel", "qwen3_debugmodel_moe"]
)
def test_debug_configs_validate_as_they_are(capsys, name):
    """``--validation.enable`` on a bundled debug config passes the checks: its validation
    sequences fit the model's RoPE table (the default validation.seq_len would not)."""
    path = str(REPO_ROOT / "train_configs" / f"{name}.toml")
    code = main(["--job.config_file", path, "--validation.enable"])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("torchrun_has_flag", [True, False], ids=["torch-2.13", "torch-2.11"])
def test_launcher_passes_shutdown_timeout_only_to_a_torchrun_that_has_it(
    monkeypatch, tmp_path, torchrun_has_flag
):
    """torchrun gained --shutdown-timeout in torch 2.13; handing it to torch 2.11's torchrun
    stopped every ./run_train.sh there ("unrecognized arguments"). Both get the 5 s teardown."""
    import torch.distributed.run as torchrun

    import torchtitan.tools.lifecycle as lifecycle
    from torchtitan.launch import main as launch_main

    real_parser = torchrun.get_args_parser

    def parser():
        # Either torch may be installed (2.11 on GPU machines): give its parser the flag, or
        # take it away, whichever this case needs.
        p = real_parser()
        present = "--shutdown-timeout" in p._option_string_actions
        if torchrun_has_flag and not present:
            p.add_argument("--shutdown-timeout", "--shutdown_timeout", type=int, default=None)
        if not torchrun_has_flag and present:
            action = p._option_string_actions["--shutdown-timeout"]
            p._remove_action(action)
            for group in p._action_groups:
                if action in group._group_actions:
                    group._group_actions.remove(action)
            for name in action.option_strings:
                p._option_string_actions.pop(name)
        return p

    ran, teardown = [], []
    monkeypatch.setattr(torchrun, "get_args_parser", parser)
    monkeypatch.setattr(torchrun, "run", ran.append)
    monkeypatch.setattr(lifecycle, "honour_shutdown_timeout_on_failure", teardown.append)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    code = launch_main(["--nproc_per_node=2", "--log-dir", str(tmp_path), "--signals-to-handle",
                        "SIGINT", "--", "-m", "some.module"])
    assert code == 0 and len(ran) == 1 and teardown == [5]
    assert ran[0].nproc_per_node == "2" and ran[0].training_script == "some.module"
    assert getattr(ran[0], "shutdown_timeout", None) == (5 if torchrun_has_flag else None)


@pytest.mark.parametrize("nproc, started", [("4", False), ("2", True)])
def test_more_ranks_than_visible_gpus_is_one_line_before_torchrun(monkeypatch, capsys, tmp_path,
                                                                  nproc, started):
    """NGPU=4 on a machine that shows 2 GPUs: ranks 2 and 3 used to die in
    torch.cuda.set_device ("invalid device ordinal") after the others had started."""
    import torch
    import torch.distributed.run as torchrun

    import torchtitan.tools.device as device
    from torchtitan.launch import main as launch_main

    monkeypatch.setattr(device, "device_type", "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    ran: list = []
    monkeypatch.setattr(torchrun, "run", ran.append)
    code = launch_main([f"--nproc_per_node={nproc}", "--log-dir", str(tmp_path / "logs"), "--",
                        "-m", "torchtitan.train", "--job.config_file", DEBUG,
                        "--job.dump_folder", str(tmp_path / "dump")])
    err = capsys.readouterr().err
    if started:
        assert code == 0 and len(ran) == 1, err
    else:
        assert code == 2 and ran == []
        assert err == (
            "error: --nproc_per_node=4 (NGPU) starts 4 ranks on this machine, but it has 2 "
            "visible GPUs (CUDA_VISIBLE_DEVICES=0,1): one rank per GPU; lower NGPU, or add nodes\n"
        )
