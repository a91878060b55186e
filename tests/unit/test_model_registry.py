"""Model registry: lookups, errors, lazy builders, flavor copies."""

from __future__ import annotations

import math
import sys

import pytest
import torch

import torchtitan.models as models
from tests.conftest import TOKENIZER_DIR
from torchtitan.config.job_config import Model
from torchtitan.models import (
    LazyCallable,
    ModelSpec,
    get_model_spec,
    lazy,
    list_model_specs,
    register_model_spec,
)
from torchtitan.models.common.rope import precompute_freqs_cis
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Transformer


def test_builtin_families_registered():
    assert {"llama3", "llama2"} <= set(list_model_specs())
    spec = get_model_spec("llama3")
    assert spec.name == "llama3" and spec.model_cls is Transformer
    assert {"debugmodel", "debugmodel_tiny", "1B", "8B", "70B", "405B"} <= set(spec.flavors)
    assert set(get_model_spec("llama2").flavors) == {"debugmodel", "7B", "13B", "70B"}
    assert get_model_spec("llama2").model_cls is Transformer


def test_every_family_folder_is_a_builtin_known_before_anything_imports_it(monkeypatch):
    """A family folder left out of the table is missing from "known models" and the
    did-you-mean until something happens to import it."""
    from pathlib import Path

    folders = {p.parent.name for p in Path(models.__file__).parent.glob("*/__init__.py")}
    assert set(models._BUILTIN_FAMILIES) == folders - {"common"}
    monkeypatch.setattr(models, "_REGISTRY", {})  # as in a fresh process: nothing imported
    monkeypatch.setattr(models, "_builtins_loaded", False)
    for family in models._BUILTIN_FAMILIES:  # a fresh process runs each family's __init__
        monkeypatch.delitem(sys.modules, f"torchtitan.models.{family}", raising=False)
    with pytest.raises(ValueError, match="Did you mean 'deepseek_v3'") as info:
        get_model_spec("deepseek_v4")
    assert "deepseek_v3, gpt_oss, llama2, llama3, qwen3" in str(info.value)


@pytest.mark.parametrize("family", ["llama3", "llama2"])
def test_spec_hooks_resolve_and_build(family):
    """A mistyped lazy target fails here, not in the middle of a run; the hooks build real things."""
    spec = get_model_spec(family)
    hooks = {k: v for k, v in vars(spec).items() if isinstance(v, LazyCallable)}
    assert {"parallelize_fn", "build_tokenizer_fn", "build_dataloader_fn"} <= set(hooks)
    for name, hook in hooks.items():
        assert callable(hook.resolve()), name  # ImportError names the target otherwise
    tokenizer = spec.build_tokenizer_fn(Model(hf_assets_path=str(TOKENIZER_DIR)))
    assert tokenizer.vocab_size == 2256 and tokenizer.encode("hi", bos=True)[0] == tokenizer.bos_id
    loss_fn = spec.build_loss_fn()
    logits, labels = torch.zeros(1, 3, 4), torch.tensor([[0, 1, -100]])  # -100: ignored label
    assert loss_fn(logits, labels).item() == pytest.approx(2 * math.log(4))  # summed, not mean


def test_unknown_model_lists_known_names_and_suggests():
    with pytest.raises(ValueError) as err:
        get_model_spec("llama4")
    msg = str(err.value)
    assert "model.name 'llama4' is not a registered model" in msg
    assert "llama2" in msg and "llama3" in msg and "Did you mean" in msg
    with pytest.raises(ValueError, match="known models: .*llama3"):
        get_model_spec("not a model")


def test_unknown_flavor_and_flavor_copies():
    spec = get_model_spec("llama3")
    with pytest.raises(
        ValueError, match=r"model.flavor '8b' is not a flavor of model 'llama3'.*Did you mean '8B'"
    ):
        spec.get_model_args("8b")
    args = spec.get_model_args("debugmodel")
    assert isinstance(args, TransformerModelArgs)
    args.vocab_size = 5
    assert spec.model_args["debugmodel"].vocab_size == 2256


def test_register_custom_spec_and_duplicate_error():
    spec = ModelSpec(
        name="unit_test_family",
        model_cls=Transformer,
        model_args={"tiny": TransformerModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=11)},
        parallelize_fn=None,
        pipelining_fn=None,
        build_tokenizer_fn=None,
        build_dataloader_fn=None,
        build_loss_fn=None,
    )
    try:
        register_model_spec(spec)
        register_model_spec(spec)  # re-registering the same object is harmless
        assert get_model_spec("unit_test_family") is spec
        clash = ModelSpec(**{**spec.__dict__, "model_args": {}})
        with pytest.raises(ValueError, match="'unit_test_family' is already registered"):
            register_model_spec(clash)
    finally:
        models._REGISTRY.pop("unit_test_family", None)


def test_lazy_callable_resolves_on_first_call_only():
    fn = lazy("torchtitan.models.common.rope:precompute_freqs_cis")
    assert fn.resolve() is precompute_freqs_cis
    assert fn(4, 3).shape == (3, 2)
    missing = lazy("torchtitan.no_such_module:build")  # creating it does not import
    with pytest.raises(ImportError, match="torchtitan.no_such_module:build is not available"):
        missing()
    with pytest.raises(ImportError, match="has no attribute 'nope'"):
        lazy("torchtitan.models.spec:nope").resolve()
    with pytest.raises(ValueError, match="must look like 'package.module:function'"):
        lazy("torchtitan.models.spec.nope")
