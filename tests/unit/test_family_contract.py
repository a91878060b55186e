"""The contract every registered family keeps, checked for each one found in the registry (a
new family is covered without editing this file): its debug flavors build on meta and count
their parameters as transformers does; its HF adapter round-trips our state dict exactly and
writes the keys and shapes that transformers' model of its HF model type saves; the registry
finds the family from that model type, from those HF names and from our FQNs. FSDP2 on two
gloo ranks: tests/distributed/test_family_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_script
from torchtitan.components.checkpoint import CheckpointError, hf_check
from torchtitan.models import get_model_spec, hf_lookup, list_model_specs
from torchtitan.models.common.hf_adapter import HFStateDictAdapter, canonical_key

FAMILIES = list_model_specs()
CASES = [
    (family, flavor)
    for family in FAMILIES
    for flavor in get_model_spec(family).flavors
    if flavor.startswith("debugmodel")
]
SEQ_LEN = 2048


def _adapter(family: str, flavor: str):
    spec = get_model_spec(family)
    assert spec.state_dict_adapter is not None, (
        f"family {family} has no HF adapter: declare one (docs/models.md, adding a family)")
    cls = hf_lookup.adapter_class(spec)
    assert issubclass(cls, HFStateDictAdapter), f"{family}'s adapter is not an HFStateDictAdapter"
    return spec, spec.state_dict_adapter(spec.get_model_args(flavor))


def _meta_model(family: str, flavor: str):
    spec = get_model_spec(family)
    with torch.device("meta"):
        return spec.model_cls(spec.get_model_args(flavor))


def _random_state_dict(model, adapter) -> dict[str, torch.Tensor]:
    """Random tensors of the model's shapes; what HF cannot hold is zero (lossless)."""
    gen = torch.Generator().manual_seed(0)
    drops = adapter.active_export_drops()
    sd = {}
    for key, t in model.state_dict().items():
        if canonical_key(key)[0] in drops:
            sd[key] = torch.zeros(t.shape, dtype=t.dtype)
        else:
            sd[key] = torch.randn(t.shape, generator=gen).to(t.dtype)
    if getattr(adapter.model_args, "tie_word_embeddings", False):
        sd["output.weight"] = sd["tok_embeddings.weight"]
    return sd


def test_every_family_is_covered():
    assert {"llama3", "llama2", "qwen3", "deepseek_v3"} <= set(FAMILIES)
    assert {f for f, _ in CASES} == set(FAMILIES), "every family has a debugmodel flavor"


@pytest.mark.parametrize(("family", "flavor"), CASES)
def test_parameter_count(family, flavor):
    """get_nparams_and_flops counts each parameter once (tied ones too), as transformers'
    model of the same config.json does."""
    model = _meta_model(family, flavor)
    nparams, flops = model.model_args.get_nparams_and_flops(model, SEQ_LEN)
    unique = {id(p): p for _, p in model.named_parameters(remove_duplicate=False)}
    assert nparams == sum(p.numel() for p in unique.values()) and flops > 0
    if get_model_spec(family).state_dict_adapter is None:
        return  # refused by the HF tests below
    hf_model = _transformers_model(*_adapter(family, flavor))
    if hf_model is not None:
        assert nparams == sum(p.numel() for p in hf_model.parameters())


@pytest.mark.parametrize(("family", "flavor"), CASES)
def test_hf_round_trip_is_exact(family, flavor):
    _, adapter = _adapter(family, flavor)
    sd = _random_state_dict(_meta_model(family, flavor), adapter)
    assert adapter.dropped_by_export(sd) == ""
    hf_sd = adapter.to_hf(sd)
    back = adapter.from_hf(hf_sd)
    assert sorted(back) == sorted(sd)
    for key, value in sd.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


@pytest.mark.parametrize(("family", "flavor"), CASES)
def test_export_names_what_it_drops(family, flavor):
    """A non-zero tensor HF cannot hold is reported by dropped_by_export (exports refuse it)."""
    _, adapter = _adapter(family, flavor)
    sd = _random_state_dict(_meta_model(family, flavor), adapter)
    dropped = [k for k in sd if canonical_key(k)[0] in adapter.active_export_drops()]
    if not dropped:
        return  # HF holds every tensor of this flavor
    sd[dropped[0]] = torch.ones_like(sd[dropped[0]])
    assert adapter.dropped_by_export(sd)
    assert not set(adapter.to_hf(sd)) & set(dropped)
    # also under the names of a block wrapped by activation checkpointing (live modules)
    layer, rest = dropped[0].split(".", 2)[1:]
    wrapped = f"layers.{layer}._checkpoint_wrapped_module.{rest}"
    assert adapter.dropped_by_export({wrapped: torch.ones_like(sd[dropped[0]])})


def _transformers_model(spec, adapter):
    """transformers' model (on meta) of the adapter's config.json; None when transformers is
    missing or does not know the model type."""
    transformers = pytest.importorskip("transformers")
    config = adapter.hf_config()
    try:
        hf_config = transformers.AutoConfig.for_model(**config)
    except ValueError:
        return None
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(hf_config)


@pytest.mark.parametrize(("family", "flavor"), CASES)
def test_hf_keys_are_what_transformers_saves(family, flavor):
    spec, adapter = _adapter(family, flavor)
    hf_model = _transformers_model(spec, adapter)
    if hf_model is None:
        pytest.skip(f"transformers has no model type {adapter.hf_config()['model_type']!r}")
    from transformers.core_model_loading import revert_weight_conversion

    saved = revert_weight_conversion(hf_model, hf_model.state_dict())  # save_pretrained's names
    if adapter.hf_config().get("tie_word_embeddings"):
        saved.pop("lm_head.weight", None)  # a tied lm_head is not saved
    want = {k: tuple(v.shape) for k, v in saved.items()}
    have = {k: tuple(v.shape) for k, v in adapter.to_hf(_meta_model(family, flavor).state_dict()).items()}
    assert sorted(set(want) ^ set(have)) == [] and want == have


@pytest.mark.parametrize(("family", "flavor"), CASES)
def test_registry_finds_the_family(family, flavor):
    """From the config.json model_type, from the HF weight names and from our FQNs."""
    spec, adapter = _adapter(family, flavor)
    config = adapter.hf_config()
    assert config["model_type"] in spec.hf_model_types
    assert hf_lookup.same_adapter(hf_lookup.spec_for_hf_model_type(config["model_type"]), spec)
    sd = _meta_model(family, flavor).state_dict()
    assert hf_lookup.same_adapter(hf_lookup.spec_for_hf_keys(adapter.to_hf(sd)), spec)
    assert hf_lookup.same_adapter(hf_lookup.spec_for_fqns(sd), spec)
    assert hf_lookup.fqns_fit(spec, sd)
    hf_check.compare_with_flavor(config, adapter, "config.json")  # the config side round-trips


# --------------------------------------------------------------------------- a new family




@pytest.fixture
def toy_family(monkeypatch):
    """A family registered at run time: Llama's model with HF names of its own."""
    import torchtitan.models as models
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model import Transformer
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from torchtitan.models.spec import ModelSpec

    class ToyAdapter(Llama3StateDictAdapter):
        hf_name = "Toy"
        key_map = {k: v.replace("self_attn.", "attn.") for k, v in Llama3StateDictAdapter.key_map.items()}

        def hf_config(self, dtype: str = "float32") -> dict:
            return {**super().hf_config(dtype), "model_type": "toy_llama"}

    spec = ModelSpec(name="toy", model_cls=Transformer, model_args={"debugmodel": llama3_args["debugmodel_tiny"]},
                     state_dict_adapter=ToyAdapter, hf_model_types=("toy_llama",))
    list_model_specs()  # the built-ins first
    monkeypatch.setitem(models._REGISTRY, "toy", spec)
    return spec


def test_a_new_family_is_found_without_editing_a_table(toy_family):
    args = toy_family.get_model_args("debugmodel")
    with torch.device("meta"):
        sd = toy_family.model_cls(args).state_dict()
    toy_keys = toy_family.state_dict_adapter(args).to_hf(sd)
    assert hf_lookup.spec_for_hf_model_type("toy_llama") is toy_family
    assert load_script("convert_hf_to_dcp")._model_name({"model_type": "toy_llama"}, None) == "toy"
    assert hf_lookup.spec_for_hf_keys(toy_keys) is toy_family
    assert hf_check.hf_kind_of_keys(toy_keys) == "toy_llama"
    with pytest.raises(CheckpointError, match="model_type is llama, but the weights are a toy_llama model's"):
        hf_check.check_config_matches_weights({"model_type": "llama"}, toy_keys, "config.json")
    # our FQNs are Llama's: llama3 (which owns the adapter it extends) is named, toy accepted
    assert hf_lookup.spec_for_fqns(sd).name == "llama3" and hf_lookup.fqns_fit(toy_family, sd)
