"""Every bundled config either runs as shipped on this CPU machine or says in its header what it
needs (GPUs, a downloaded tokenizer) and how to dry-run it; the header's commands work."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from torchtitan.components.tokenizer import hf_repo_for
from torchtitan.config.manager import ConfigManager
from torchtitan.preflight import check_run

CONFIGS = sorted((REPO_ROOT / "train_configs").glob("*.toml"))


def header(path: Path) -> list[str]:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return lines


def dry_run_command(lines: list[str]) -> list[str] | None:
    """The header's ``NGPU=... COMM_MODE=fake_backend ... ./run_train.sh ...`` command."""
    text = " ".join(lines)
    match = re.search(r"(NGPU=\d+ COMM_MODE=fake_backend .*?\./run_train\.sh[^;]*)", text)
    if match is None:
        return None
    return shlex.split(match.group(1).replace("\\", " "))


def assets_in_repo(cfg) -> bool:
    path = cfg.model.tokenizer_path or cfg.model.hf_assets_path
    return bool(path) and (REPO_ROOT / path).resolve().is_relative_to(REPO_ROOT / "tests")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_runs_as_shipped_or_says_what_it_needs(path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.delenv("COMM_MODE", raising=False)
    cfg = ConfigManager().parse_args(["--job.config_file", str(path)])
    if assets_in_repo(cfg):  # a CPU config: the launcher's full check passes as shipped
        check_run(cfg, 1, device_type="cpu")
        return
    lines = header(path)
    folder = cfg.model.hf_assets_path
    download = f"hf download {hf_repo_for(Path(folder).name)} --include '*tokenizer*' --local-dir {folder}"
    assert any(download in line for line in lines), lines
    assert any("CUDA GPUs" in line for line in lines), lines
    command = dry_run_command(lines)
    assert command is not None, f"{path.name}: no COMM_MODE=fake_backend dry-run line"
    env = dict(a.split("=", 1) for a in command[: command.index("./run_train.sh")])
    flags = command[command.index("./run_train.sh") + 1 :]
    assert (env["MODULE"], env["CONFIG"]) == (cfg.model.name, path.stem)
    # The dry run's own checks (config and layout at NGPU ranks) pass with the header's flags.
    dry = ConfigManager().parse_args(["--module", env["MODULE"], "--config", env["CONFIG"], *flags])
    check_run(dry, int(env["NGPU"]), on_this_machine=False)
    # On a fresh clone, the real run stops in one line that shows the same download command.
    if not os.path.exists(folder):
        with pytest.raises(FileNotFoundError) as info:
            check_run(dry, int(env["NGPU"]), device_type="cuda")
        assert download in str(info.value)
