"""More bad inputs, each one clear line naming its setting (exit 2 through the entry points),
found by feeding the trainer and the launcher realistic user mistakes."""

from __future__ import annotations

import pytest

from tests.conftest import REPO_ROOT
from torchtitan.config.manager import ConfigManager
from torchtitan.preflight import check_run

DEBUG = str(REPO_ROOT / "train_configs" / "debug_model.toml")


def cfg_of(tmp_path, *flags: str):
    return ConfigManager().parse_args(
        ["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path / "dump"), *flags]
    )


def refused(tmp_path, *flags: str) -> str:
    """The pre-flight's one line for ``flags`` (the plan the ranks run raises the same)."""
    with pytest.raises((ValueError, FileNotFoundError, ImportError)) as info:
        check_run(cfg_of(tmp_path, *flags), 1, device_type="cpu")
    message = str(info.value)
    assert "\n" not in message
    return message


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


def test_custom_import_failing_inside_keeps_its_own_error(tmp_path, monkeypatch):
    (tmp_path / "broken_register.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency"):
        check_run(cfg_of(tmp_path, "--experimental.custom_import", "broken_register"), 1,
                  device_type="cpu")
