"""Where documents come from: the dataset registry and loading through HF ``datasets``
(Hub datasets, streaming or not, and local json/jsonl/parquet/txt files or folders)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from torchtitan.datasets import text_checks
from torchtitan.tools.logging import logger_level

__all__ = [
    "DATASETS",
    "DatasetConfig",
    "check_hub",
    "check_source",
    "data_files",
    "describe",
    "load_text_dataset",
    "local_files",
    "resolve_dataset",
]

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class DatasetConfig:
    """How to load one dataset."""

    path: str
    """HF Hub dataset id (e.g. ``allenai/c4``), or a local file/folder when ``local``."""

    local: bool = False
    """``path`` is on disk (relative paths resolve against the repo root, then the CWD)."""

    hf_name: str | None = None
    """HF dataset config name (e.g. ``en`` for C4)."""

    split: str = "train"
    """Split to read (local files always load as ``train``)."""

    streaming: bool = False
    """Read lazily as an HF ``IterableDataset`` instead of a map-style Arrow dataset."""

    text_column: str = "text"
    """Column holding each document's text."""


DATASETS: dict[str, DatasetConfig] = {
    "c4": DatasetConfig(path="allenai/c4", hf_name="en", split="train", streaming=True),
    "c4_validation": DatasetConfig(
        path="allenai/c4", hf_name="en", split="validation", streaming=True
    ),
    "c4_test": DatasetConfig(path="tests/assets/c4_test/data.json", local=True),
    "c4_test_validation": DatasetConfig(path="tests/assets/c4_test/validation.json", local=True),
}

# File suffix -> HF packaged builder.
_SUFFIX_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".parquet": "parquet",
    ".txt": "text",
}


def _builder_for(path: Path) -> str | None:
    name = path.name.lower()
    for suffix in sorted(_SUFFIX_BUILDERS, key=len, reverse=True):
        if name.endswith(suffix):
            return _SUFFIX_BUILDERS[suffix]
    return None


def resolve_dataset(dataset_name: str, dataset_path: str | None = None) -> DatasetConfig:
    """The loading config for ``dataset_name``, with ``dataset_path`` (a local path) overriding it.

    A registered name keeps its options (e.g. C4 stays streaming) with the path swapped;
    an unregistered name needs ``dataset_path``, else ``ValueError`` lists the known names.
    """
    if dataset_path:
        base = DATASETS.get(dataset_name, DatasetConfig(path=dataset_path))
        return replace(base, path=dataset_path, local=True, hf_name=None, split="train")
    if dataset_name not in DATASETS:
        raise ValueError(
            f"Unknown dataset {dataset_name!r}: use one of {sorted(DATASETS)}, or give its local "
            "file/folder with --training.dataset_path (in a mix: NAME=PATH:WEIGHT)."
        )
    return DATASETS[dataset_name]


def _local_path(cfg: DatasetConfig, dataset_name: str) -> Path:
    """The on-disk path of a local dataset.

    A registry entry's own path is relative to the repo root; a user's ``dataset_path`` is
    relative to the CWD, falling back to the repo root.
    """
    path = Path(cfg.path).expanduser()
    entry = DATASETS.get(dataset_name)
    if entry is not None and entry.local and cfg.path == entry.path:
        full = path if path.is_absolute() else REPO_ROOT / path
        if not full.exists():
            raise FileNotFoundError(
                f"Dataset {dataset_name!r} expects {full}, which is missing: "
                "run `python scripts/generate_test_assets.py` to regenerate the test assets."
            )
        return full
    if path.exists():
        return path
    if not path.is_absolute() and (REPO_ROOT / path).exists():
        return REPO_ROOT / path
    raise FileNotFoundError(f"Dataset path {cfg.path} does not exist: {PATH_HINT}.")


PATH_HINT = "fix --training.dataset_path (or --validation.dataset_path)"
"""Where a missing local dataset path comes from; a caller that knows the section narrows it."""


def in_section(err: Exception, section: str) -> str:
    """``err``'s line for a dataset of the ``[section]`` config section (training, validation)."""
    return f"{section} dataset: {str(err).replace(PATH_HINT, f'fix --{section}.dataset_path')}"


@contextlib.contextmanager
def _no_download_count():
    """Keep HF ``datasets`` from pinging its servers (a download counter) for local files."""
    import datasets.config as hf_config

    old = hf_config.HF_UPDATE_DOWNLOAD_COUNTS
    hf_config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        hf_config.HF_UPDATE_DOWNLOAD_COUNTS = old


def _saved_dataset(path: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk``."""
    return path.is_dir() and (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


def local_files(path: Path) -> list[Path]:
    """The data files of the local dataset at ``path`` (a file, or a folder's files in sorted
    order), checked: one known format, none empty; one-line errors otherwise."""
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and _builder_for(p)
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise FileNotFoundError(
                f"Dataset folder {path} holds no .json/.jsonl/.parquet/.txt files."
            )
    else:
        files = [path]
    builders = {_builder_for(f) for f in files}
    if None in builders:
        raise ValueError(
            f"Dataset file {path} is not .json/.jsonl(.gz), .parquet or .txt; convert it to one."
        )
    if len(builders) > 1:
        raise ValueError(
            f"Dataset folder {path} mixes file formats ({sorted(builders)}); keep one format."
        )
    text_checks.check_not_empty(files)
    return files


def data_files(cfg: DatasetConfig, dataset_name: str = "") -> list[Path]:
    """The files of a local dataset (none for a ``save_to_disk`` folder or a Hub dataset)."""
    if not cfg.local:
        return []
    path = _local_path(cfg, dataset_name)
    return [] if _saved_dataset(path) else local_files(path)


_ANSWERED: set[str] = set()
"""Hub URLs that answered in this process."""


def _hub_offline() -> bool:
    return any(
        os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE")
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def _probe_hub(url: str, timeout: float) -> str | None:
    """None when ``url`` answers within ``timeout`` seconds (any HTTP status below 500), else
    why not. Through huggingface_hub's own HTTP session (its proxies and certificates)."""
    result: list[str | None] = []

    def probe() -> None:
        try:
            from huggingface_hub import get_session

            status = get_session().head(url, timeout=timeout).status_code
            result.append(None if status < 500 else f"it answered HTTP {status}")
        except Exception as err:  # noqa: BLE001 - any failure to get an answer counts
            detail = (str(err).strip().splitlines() or [""])[0]
            result.append(f"{type(err).__name__}: {detail}" if detail else type(err).__name__)

    thread = threading.Thread(target=probe, daemon=True)  # bounds DNS look-ups as well
    thread.start()
    thread.join(timeout + 1)
    return result[0] if result else f"no answer within {timeout:g} s"


def check_hub(cfg: DatasetConfig, dataset_name: str = "", timeout: float = 5.0) -> None:
    """A streaming Hub dataset reads the Hub as it trains: one line, in seconds, when offline
    mode is set or the Hub does not answer (HF ``datasets`` would retry for half a minute)."""
    if cfg.local or not cfg.streaming:  # map-style Hub data may come from the local cache
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    if _hub_offline():
        why = "offline mode is set (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)"
    else:
        url = f"{endpoint}/api/datasets/{cfg.path}"
        if url in _ANSWERED:
            return
        why = _probe_hub(url, timeout)
        if why is None:
            _ANSWERED.add(url)  # once per process: validation rebuilds its loader every time
            return
        why = f"the Hub ({endpoint}) is unreachable ({why})"
    name = dataset_name or cfg.path
    raise ValueError(
        f"dataset {name!r} streams {cfg.path} from the Hugging Face Hub, but {why}: train on "
        "local data instead: --training.dataset c4_test (the bundled sample; "
        "c4_test_validation for validation), or a local copy with --training.dataset_path "
        "(--validation.dataset_path)"
    )


def check_source(cfg: DatasetConfig, dataset_name: str = "") -> None:
    """What can be checked of a dataset before reading it: a local one's files (present, one
    format, not empty), a streaming Hub one's reachability."""
    if cfg.local:
        data_files(cfg, dataset_name)
    else:
        check_hub(cfg, dataset_name)


def describe(cfg: DatasetConfig) -> str:
    """Where a dataset's documents come from, e.g. ``allenai/c4 (en, train)`` or a path."""
    if cfg.local:
        return cfg.path
    return f"{cfg.path} ({', '.join(x for x in (cfg.hf_name, cfg.split) if x)})"


def _load_local(path: Path, streaming: bool, column: str = "text"):
    import datasets

    if _saved_dataset(path):
        ds = datasets.load_from_disk(str(path))  # written by Dataset.save_to_disk
        return ds.to_iterable_dataset() if streaming else ds
    files = local_files(path)
    try:
        # HF datasets logs its own ERROR line ("Failed to load JSON from file ...") before
        # raising; the failure is reported in one line of ours instead
        with _no_download_count(), logger_level(logging.getLogger("datasets"), logging.CRITICAL):
            ds = datasets.load_dataset(
                _builder_for(files[0]), data_files=[str(f) for f in files], split="train",
                streaming=streaming,
            )
    except Exception as err:  # noqa: BLE001 - HF/pyarrow errors are many lines: name the bad line
        raise text_checks.explain_load_failure(files, column, err) from None
    text_checks.check_text_feature(ds, files, column, str(path))
    return ds


def load_text_dataset(cfg: DatasetConfig, dataset_name: str = ""):
    """Load ``cfg`` with HF ``datasets``: a ``Dataset``, or an ``IterableDataset`` when streaming."""
    if cfg.local:
        ds = _load_local(_local_path(cfg, dataset_name), cfg.streaming, cfg.text_column)
    else:
        import datasets

        check_hub(cfg, dataset_name)
        try:
            ds = datasets.load_dataset(
                cfg.path, name=cfg.hf_name, split=cfg.split, streaming=cfg.streaming
            )
        except ConnectionError as err:  # offline without a cached copy: one line, not 60
            raise ValueError(
                f"Dataset {dataset_name or cfg.path}: {err}; use a local copy with "
                "--training.dataset_path (--validation.dataset_path)"
            ) from None
    columns = getattr(ds, "column_names", None)
    if columns is not None and cfg.text_column not in columns:
        raise ValueError(
            f"Dataset {dataset_name or cfg.path} has no {cfg.text_column!r} column "
            f"(columns: {columns}); each document's text must be in {cfg.text_column!r}."
        )
    return ds
