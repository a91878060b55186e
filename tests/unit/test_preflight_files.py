"""The pre-flight's checks of where a run starts (``check_run(on_this_machine=True)``): the dump
folder, the tokenizer file, the datasets (names, local files, a streaming Hub dataset) and
what the checkpoint settings load. Each is the rank's own check function, so the rank's side
is tested through the same function where the rank calls it."""

from __future__ import annotations

import contextlib
import http.server
import os
import subprocess
import threading
import time

import pytest

from tests.conftest import REPO_ROOT
from torchtitan.config.manager import ConfigManager
from torchtitan.preflight import check_dump_folder, check_run

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


# --- the dump folder -------------------------------------------------------------------------
@contextlib.contextmanager
def read_only(folder):
    """``folder`` made unwritable, for root too (root ignores the mode bits: chattr +i)."""
    folder.chmod(0o555)
    immutable = False
    try:
        if os.access(folder, os.W_OK):
            done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=False)
            if done.returncode != 0:
                pytest.skip("no way to make a folder read-only for this user here")
            immutable = True
        yield folder
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)


def test_dump_folder_that_is_a_file_is_refused(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    message = refused(tmp_path, "--job.dump_folder", str(afile))
    assert message == f"job.dump_folder={afile} is a file, not a folder: use another --job.dump_folder"
    message = refused(tmp_path, "--job.dump_folder", str(afile / "sub"))
    assert f"job.dump_folder={afile / 'sub'} cannot be created: {afile} is a file" in message


@pytest.mark.subprocess_ok  # chattr, when running as root
def test_read_only_dump_folder_is_refused_checkpointing_or_not(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    with read_only(folder):
        for extra in ([], ["--checkpoint.enable"]):
            message = refused(tmp_path, "--job.dump_folder", str(folder), *extra)
            assert message.startswith(f"job.dump_folder={folder} is not writable (")
        message = refused(tmp_path, "--job.dump_folder", str(folder / "new"))
        assert message.startswith(f"job.dump_folder={folder / 'new'} cannot be created in {folder} (")


def test_dump_folder_check_creates_nothing(tmp_path):
    folder = tmp_path / "a" / "b"
    check_dump_folder(str(folder))
    assert list(tmp_path.iterdir()) == []
    folder.mkdir(parents=True)
    check_dump_folder(str(folder))
    assert list(folder.iterdir()) == []


def test_every_rank_checks_the_dump_folder_before_training(tmp_path):
    """``python -m torchtitan.train`` without the launcher: the rank's MetricsProcessor (built
    before the first step) refuses it in one line, not the metrics file after step 1."""
    from torchtitan.components.metrics import MetricsProcessor

    afile = tmp_path / "file"
    afile.write_text("x")
    cfg = cfg_of(tmp_path, "--job.dump_folder", str(afile))
    with pytest.raises(ValueError, match="is a file, not a folder"):
        MetricsProcessor(cfg, rank=1, compute_dtype="float32")


# --- tokenizer, datasets, checkpoint ----------------------------------------------------------
def test_garbage_tokenizer_file(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.model").write_text("not a tokenizer\n")
    message = refused(tmp_path, "--model.hf_assets_path", str(folder))
    assert "is neither a tiktoken ranks file, a sentencepiece model nor a HF tokenizer.json" in message


def test_unknown_dataset_name_also_inside_a_mix(tmp_path):
    message = refused(tmp_path, "--training.dataset", "c4_test:0.5,nope:0.5")
    assert message.startswith("Unknown dataset 'nope': use one of ['c4', 'c4_test'")
    assert "(in a mix: NAME=PATH:WEIGHT)" in message
    message = refused(tmp_path, "--validation.enable", "--validation.dataset", "nope")
    assert message.startswith("Unknown dataset 'nope'")


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"", "is empty (0 bytes): it holds no documents"),
        (b"\n  \n\n", "holds only whitespace: it holds no documents"),
        (None, "holds no .json/.jsonl/.parquet/.txt files"),
    ],
    ids=["empty-file", "blank-file", "empty-folder"],
)
def test_empty_local_dataset(tmp_path, content, needle):
    path = tmp_path / "data"
    if content is None:
        path.mkdir()
    else:
        path = tmp_path / "data.jsonl"
        path.write_bytes(content)
    assert needle in refused(tmp_path, "--training.dataset_path", str(path))
    mix = f"c4_test:0.5,mine={path}:0.5"
    assert needle in refused(tmp_path, "--training.dataset", mix)


def test_exclude_from_loading_typo(tmp_path):
    message = refused(tmp_path, "--checkpoint.exclude_from_loading", "optimzer")
    assert message == (
        "checkpoint.exclude_from_loading has unknown name(s) ['optimzer']; valid names: "
        "['model', 'optimizer', 'lr_scheduler', 'dataloader', 'train_state']"
    )
    check_run(cfg_of(tmp_path, "--checkpoint.exclude_from_loading", "optimizer,dataloader"), 1,
              device_type="cpu")


def test_missing_initial_load_path(tmp_path):
    missing = tmp_path / "nowhere"
    for extra in ([], ["--checkpoint.enable"]):
        message = refused(tmp_path, "--checkpoint.initial_load_path", str(missing), *extra)
        assert message == f"checkpoint.initial_load_path={missing} does not exist; fix the path or unset it"
    # The rest of the first load's plan comes along: a load_step that is not there.
    message = refused(tmp_path, "--checkpoint.enable", "--checkpoint.load_step", "7")
    assert message.startswith("checkpoint.load_step=7: cannot load")


# --- a streaming Hub dataset ----------------------------------------------------------------
@pytest.fixture
def online(monkeypatch):
    """Offline mode off (the tests set it): huggingface_hub reads it once, at import."""
    import huggingface_hub.constants as hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)


@pytest.fixture
def local_hub(online, monkeypatch):
    """A local HTTP server standing in for the Hub (the tests never reach the internet)."""

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield
    server.shutdown()
    server.server_close()


def test_c4_offline_is_one_line_in_a_blink(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    message = refused(tmp_path, "--training.dataset", "c4")
    assert time.perf_counter() - start < 10
    assert message.startswith(
        "dataset 'c4' streams allenai/c4 from the Hugging Face Hub, but offline mode is set"
    )
    assert "--training.dataset c4_test (the bundled sample" in message
    assert "a local copy with --training.dataset_path" in message
    message = refused(tmp_path, "--validation.enable", "--validation.dataset", "c4_validation")
    assert message.startswith("dataset 'c4_validation' streams allenai/c4")


def test_unreachable_hub_is_one_line_in_seconds(tmp_path, online, monkeypatch):
    with socket_closed_port() as port:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
        start = time.perf_counter()
        message = refused(tmp_path, "--training.dataset", "c4")
    assert time.perf_counter() - start < 10
    assert f"but the Hub (http://127.0.0.1:{port}) is unreachable (" in message


def test_reachable_hub_passes(tmp_path, local_hub):
    check_run(cfg_of(tmp_path, "--training.dataset", "c4"), 1, device_type="cpu")


def test_the_rank_checks_the_hub_before_loading(monkeypatch):
    """``python -m torchtitan.train`` alone: the dataloader's load refuses in one line too,
    before HF ``datasets`` retries for half a minute."""
    import datasets

    from torchtitan.datasets.sources import DATASETS, load_text_dataset

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("reached HF"))
    with pytest.raises(ValueError, match="^dataset 'c4' streams allenai/c4 .* offline mode is set"):
        load_text_dataset(DATASETS["c4"], "c4")


@contextlib.contextmanager
def socket_closed_port():
    """A local port nothing listens on (bound, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield port
