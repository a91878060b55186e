"""More bad inputs, each one clear line naming its setting (exit 2 through the entry points),
found by feeding the trainer and the launcher realistic user mistakes."""

from __future__ import annotations

import logging

import pytest

from tests.unit.test_preflight_files import cfg_of, refused
from torchtitan.preflight import check_run


# --- the plan ---------------------------------------------------------------------------------
def test_unknown_compile_backend(tmp_path):
    message = refused(tmp_path, "--compile.enable", "--compile.backend", "nope")
    assert message.startswith("compile.backend='nope' is not a torch.compile backend")
    assert "aot_eager" in message


def test_known_compile_backend_and_compile_off_pass(tmp_path):
    check_run(cfg_of(tmp_path, "--compile.enable", "--compile.backend", "aot_eager"), 1,
              device_type="cpu")
    check_run(cfg_of(tmp_path, "--compile.backend", "nope"), 1, device_type="cpu")  # unused


def test_missing_custom_import_names_the_setting(tmp_path):
    message = refused(tmp_path, "--experimental.custom_import", "no_such_pkg.register")
    assert message.startswith("experimental.custom_import='no_such_pkg.register' cannot be")
    assert "No module named 'no_such_pkg'" in message


@pytest.mark.parametrize("source, what", [
    ("import no_such_dependency\n", "(broken_register.py, line 1): ModuleNotFoundError: No module "
                                     "named 'no_such_dependency'"),
    ("x = 1\ndef f(:\n", "(broken_register.py, line 2): SyntaxError: invalid syntax"),
    ("x = 1\nraise RuntimeError('no GPU table here')\n",
     "(broken_register.py, line 2): RuntimeError: no GPU table here"),
])
def test_custom_import_failing_inside_says_where_in_one_line(tmp_path, monkeypatch, source, what):
    """A module that fails while importing: its own error with the file and line, one line
    (exit 2). A syntax error or an exception in it used to be a traceback, exit 1."""
    (tmp_path / "broken_register.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError) as info:
        check_run(cfg_of(tmp_path, "--experimental.custom_import", "broken_register"), 1,
                  device_type="cpu")
    assert str(info.value) == (
        f"experimental.custom_import='broken_register' failed while importing {what}; "
        "`python -c 'import broken_register'` shows the traceback"
    )


# --- the folders a run writes -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "key"),
    [
        (["--metrics.enable_tensorboard"], "metrics.save_tb_folder"),
        (["--profiling.enable_profiling"], "profiling.save_traces_folder"),
        (["--profiling.enable_memory_snapshot"], "profiling.save_memory_snapshot_folder"),
        ([], "comm.save_traces_folder"),  # Flight Recorder: written only when a rank stalls
    ],
)
def test_output_folder_that_is_a_file_is_refused_before_training(tmp_path, flags, key):
    """Before: TensorBoard's NotADirectoryError traceback after step 1, the profiler a
    segmentation fault at its first trace, the memory snapshot a traceback."""
    from torchtitan.components.metrics import MetricsProcessor

    afile = tmp_path / "file"
    afile.write_text("x")
    option = "--" + key
    message = refused(tmp_path, *flags, option, str(afile))
    assert message == (f"{key}={afile} is a file, not a folder: set {option} to a folder name "
                       "(under job.dump_folder)")
    # The rank (python -m torchtitan.train, no launcher) checks it too, before the first step.
    cfg = cfg_of(tmp_path, *flags, option, str(afile))
    with pytest.raises(ValueError, match=f"^{key}=.* is a file, not a folder"):
        MetricsProcessor(cfg, rank=0, compute_dtype="float32")
    assert afile.read_text() == "x"


def test_output_folder_off_feature_is_not_checked(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    check_run(cfg_of(tmp_path, "--metrics.save_tb_folder", str(afile),
                     "--profiling.save_traces_folder", str(afile)), 1, device_type="cpu")


def test_empty_dump_folder_is_refused(tmp_path):
    """Before: accepted, and the run's files (metrics, checkpoints) went to the working folder."""
    assert refused(tmp_path, "--job.dump_folder", "").startswith("job.dump_folder is empty")
    assert refused(tmp_path, "--job.dump_folder", " ").startswith("job.dump_folder is empty")


# --- data files -------------------------------------------------------------------------------
def test_gz_dataset_that_is_not_gzip(tmp_path):
    """Before: gzip.BadGzipFile's traceback from the emptiness check, exit 1."""
    path = tmp_path / "data.jsonl.gz"
    path.write_bytes(b'{"text": "plain, not compressed"}\n')
    message = refused(tmp_path, "--training.dataset_path", str(path))
    assert message.startswith(f"Dataset file {path} cannot be read (BadGzipFile: ")
    assert "gzip -t" in message


def test_truncated_gz_dataset_is_one_line(tmp_path):
    """A .gz cut short passes the pre-flight (its start is fine); before, HF's failure was
    explained by re-reading the file, whose EOFError escaped as a traceback."""
    import gzip

    from torchtitan.datasets.sources import load_text_dataset, resolve_dataset

    path = tmp_path / "data.jsonl.gz"
    whole = gzip.compress(b'{"text": "hello world"}\n' * 20000)
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError) as info:
        load_text_dataset(resolve_dataset("mine", str(path)), "mine")
    assert str(info.value).startswith(f"Dataset file {path} cannot be read (EOFError: ")


def test_bad_json_line_is_the_only_error_line(tmp_path, caplog):
    """HF datasets logged its own 'Failed to load JSON ... error: ...' line before ours."""
    from torchtitan.datasets.sources import load_text_dataset, resolve_dataset

    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "ok"}\n{broken\n')
    with caplog.at_level(logging.DEBUG, logger="datasets"), pytest.raises(
        ValueError, match=r"data.jsonl:2: not valid JSON"
    ):
        load_text_dataset(resolve_dataset("mine", str(path)), "mine")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


# --- the saved config, the environment --------------------------------------------------------
@pytest.mark.parametrize("name", [".", "sub/", "/etc/resolved.toml", "../other_run/cfg.toml"])
def test_save_config_file_outside_the_dump_folder_is_refused(tmp_path, name):
    """Before: '.' replaced the (not yet made) dump folder by the config file, '/abs' and '..'
    wrote outside it, 'sub/' wrote a file named 'sub'."""
    from torchtitan.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^job.save_config_file=.* must be a file name inside"):
        cfg_of(tmp_path, "--job.save_config_file", name)
    for fine in ("", "resolved.toml", "configs/resolved.toml"):
        cfg_of(tmp_path, "--job.save_config_file", fine)


def test_save_config_file_that_cannot_be_written_names_the_setting(tmp_path):
    """Before: '[Errno 21] Is a directory: ...' without the setting."""
    from torchtitan.build import log_resolved_config

    cfg = cfg_of(tmp_path, "--job.save_config_file", "tb")
    (tmp_path / "dump" / "tb").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"^job.save_config_file='tb' cannot be written to "):
        log_resolved_config(cfg, rank=0)
    assert (tmp_path / "dump" / "tb").is_dir()


def test_save_config_file_on_a_full_disk_says_so_and_leaves_no_tmp(tmp_path, monkeypatch):
    """Before: 'give a file name inside job.dump_folder' for a full disk, and an empty
    cfg.toml.tmp left behind."""
    import errno
    import pathlib

    from torchtitan.build import log_resolved_config

    def full_disk(self, text, *args, **kwargs):
        open(self, "w").close()  # the file is created, its bytes do not fit
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    cfg = cfg_of(tmp_path, "--job.save_config_file", "cfg.toml")
    monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
    with pytest.raises(ValueError) as info:
        log_resolved_config(cfg, rank=0)
    assert str(info.value) == (
        f"job.save_config_file='cfg.toml' cannot be written to {tmp_path}/dump/cfg.toml "
        "(No space left on device): free space there"
    )
    assert list((tmp_path / "dump").iterdir()) == []


@pytest.mark.parametrize("value", ["0", "-2"])
def test_world_size_below_one_names_the_variable(monkeypatch, value):
    """Before: torch's 'environment variable RANK expected, but not set' for WORLD_SIZE=0."""
    from torchtitan.distributed.utils import world_size_from_env

    monkeypatch.setenv("WORLD_SIZE", value)
    with pytest.raises(ValueError, match=rf"^WORLD_SIZE={value} must be >= 1"):
        world_size_from_env()


# --- checkpoint -------------------------------------------------------------------------------
def test_hf_initial_load_without_safetensors_names_the_settings(tmp_path):
    """Before: '<folder> has no *.safetensors files' from the rank, after the model was built."""
    empty = tmp_path / "hf"
    empty.mkdir()
    message = refused(tmp_path, "--checkpoint.enable", "--checkpoint.initial_load_in_hf",
                      "--checkpoint.initial_load_path", str(empty))
    assert message.startswith(
        f"checkpoint.initial_load_path={empty} with checkpoint.initial_load_in_hf: "
    )
    assert "drop --checkpoint.initial_load_in_hf" in message
