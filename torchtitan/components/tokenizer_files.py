"""Where the tokenizer file is: ``model.tokenizer_path`` / ``model.hf_assets_path``, the
repository-root fallback for relative paths, ``llama_models:llama3`` (Meta's Llama 3
tokenizer from the ``llama-models`` package) and the download hint for missing folders."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtitan.config.job_config import Model

__all__ = [
    "HF_ORGS",
    "LLAMA_MODELS_TOKENIZER",
    "download_hint",
    "hf_repo_for",
    "tokenizer_file",
]

REPO_ROOT = Path(__file__).resolve().parents[2]


LLAMA_MODELS_TOKENIZER = "llama_models:llama3"
"""A path value meaning Meta's Llama 3 tokenizer.model shipped in the ``llama-models`` package
(``pip install -e ".[llama]"``): no Hub download, no license gate."""


def _llama_models_folder(key: str) -> Path:
    """The folder of ``llama_models/llama3/tokenizer.model`` (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("llama_models")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"{key}={LLAMA_MODELS_TOKENIZER!r} needs the llama-models package: run "
            "`pip install -e '.[llama]'` (or `pip install llama-models`)"
        )
    folder = Path(spec.origin).parent / "llama3"
    if not (folder / "tokenizer.model").is_file():
        raise FileNotFoundError(f"{key}: the installed llama-models has no {folder}/tokenizer.model")
    return folder


def _resolve(path_str: str, key: str = "model.tokenizer_path") -> Path:
    """``path_str`` as given; a relative path missing from the CWD falls back to the repo root;
    ``llama_models:llama3`` is the llama-models package's Llama 3 folder."""
    if path_str.startswith("llama_models:"):
        if path_str != LLAMA_MODELS_TOKENIZER:
            raise FileNotFoundError(
                f"{key}={path_str!r}: only {LLAMA_MODELS_TOKENIZER!r} (Llama 3) is supported"
            )
        return _llama_models_folder(key)
    path = Path(path_str).expanduser()
    if not path.exists() and not path.is_absolute() and (REPO_ROOT / path).exists():
        return REPO_ROOT / path
    return path


_ASSET_FILES = ("tokenizer.model", "tokenizer.json", "original/tokenizer.model")


def _find_in_folder(folder: Path, key: str) -> Path:
    for name in _ASSET_FILES:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(
        f"No tokenizer.model or tokenizer.json in {folder} ({key}); "
        f"point {key} at a folder that holds one."
    )


def _tokenizer_file(model_cfg: Model) -> Path:
    if model_cfg.tokenizer_path:
        path = _resolve(model_cfg.tokenizer_path)
        if not path.exists():
            raise FileNotFoundError(
                f"Tokenizer file {model_cfg.tokenizer_path} does not exist: fix "
                "model.tokenizer_path, or unset it to use model.hf_assets_path."
            )
        return _find_in_folder(path, "model.tokenizer_path") if path.is_dir() else path
    if not model_cfg.hf_assets_path:
        raise FileNotFoundError(
            "No tokenizer configured: set model.hf_assets_path to a folder holding tokenizer.model."
        )
    folder = _resolve(model_cfg.hf_assets_path, "model.hf_assets_path")
    if not folder.exists():
        raise FileNotFoundError(
            f"Tokenizer folder {model_cfg.hf_assets_path} does not exist: "
            f"{download_hint(model_cfg.hf_assets_path)}, or set model.hf_assets_path to a "
            "folder holding tokenizer.model or tokenizer.json"
        )
    return _find_in_folder(folder, "model.hf_assets_path") if folder.is_dir() else folder


HF_ORGS = {"Llama-": "meta-llama", "DeepSeek-": "deepseek-ai"}
"""Folder-name prefix -> HF organisation, for the bundled configs' ``./assets/hf/<repo>``."""


def hf_repo_for(folder_name: str) -> str:
    """``org/name`` of the HF repo the bundled configs download into ``./assets/hf/<name>``
    (``<org>/<model>`` for unknown names)."""
    for prefix, org in HF_ORGS.items():
        if folder_name.startswith(prefix):
            return f"{org}/{folder_name}"
    return "<org>/<model>"


def download_hint(hf_assets_path: str) -> str:
    """How to fetch the tokenizer into ``hf_assets_path`` (see :func:`hf_repo_for`)."""
    repo = hf_repo_for(Path(hf_assets_path).name)
    return (
        f"download it with `hf download {repo} --include '*tokenizer*' --local-dir "
        f"{hf_assets_path}` (gated: accept the license on huggingface.co and run "
        "`hf auth login` first)"
    )


def tokenizer_file(model_cfg: Model) -> Path:
    """The tokenizer file ``build_tokenizer`` would read; FileNotFoundError (one line naming
    the key to fix and how to get the file) when there is none."""
    return _tokenizer_file(model_cfg)
