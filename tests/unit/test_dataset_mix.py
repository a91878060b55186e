"""Dataset mixes: ``training.dataset = "NAME[=PATH]:WEIGHT,..."``.

Two sources whose documents are told apart by their letters (lower case: source ``low``, upper
case: ``up``) are mixed 0.7 / 0.3. Each packed sequence comes from one source, drawn by a
counter hash of (seed, sequence index): the proportions hold over a long run, the draw depends
only on the seed, each source's sequences are that source's own packed stream (nothing skipped
or repeated) and a resume, also at another dp degree, continues exactly.
"""

from __future__ import annotations

import itertools
import json
import pickle

import pytest

from tests.unit.test_datasets import CHAR, _windows_to_stream
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import DataLoader
from torchtitan.config.manager import ConfigManager
from torchtitan.datasets import build_text_dataloader
from torchtitan.datasets.mix import SourceSpec, parse_dataset_spec, pick_source

SEQ = 8


def _letters(i: int, upper: bool) -> str:
    word = "".join("abcdefghij"[int(d)] for d in str(i)) + "x" * (i % 5)
    return word.upper() if upper else word


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("mix")
    for name, upper in (("low", False), ("up", True)):
        docs = [_letters(i, upper) for i in range(400)]
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return f"low={root / 'low.jsonl'}:0.7,up={root / 'up.jsonl'}:0.3"


def _loader(spec, rank=0, world=1, batch=4, seed=0, workers=0, infinite=True):
    return build_text_dataloader(
        dataset_name=spec, dataset_path=None, tokenizer=CHAR, local_batch_size=batch,
        seq_len=SEQ, dp_rank=rank, dp_world_size=world, infinite=infinite, seed=seed,
        dataloader_config=DataLoader(num_workers=workers),
    )


def _rows(loader, n_batches):
    return [
        _windows_to_stream([(x[i], y[i])])
        for x, y in itertools.islice(iter(loader), n_batches)
        for i in range(x.shape[0])
    ]


def _source(row: list[int]) -> str:
    text = CHAR.decode(row)
    low, up = any(c.islower() for c in text), any(c.isupper() for c in text)
    assert low != up, text  # every window comes from exactly one source
    return "low" if low else "up"


def test_parse_and_refuse_bad_mixes():
    assert parse_dataset_spec("c4_test") == [SourceSpec("c4_test", None, 1.0)]
    assert parse_dataset_spec("c4_test:0.7, mine=/d/x.jsonl:0.3") == [
        SourceSpec("c4_test", None, 0.7), SourceSpec("mine", "/d/x.jsonl", 0.3)
    ]
    for bad, needle in (
        ("c4_test:0", "with a weight > 0"), ("c4_test:-1,b:1", "with a weight > 0"),
        ("c4_test:nan", "with a weight > 0"), ("c4_test,b:1", "'c4_test' is not NAME"),
        ("a:1,a:2", "names 'a' twice"), (":1", "is not NAME"),
    ):
        with pytest.raises(ValueError, match=needle):
            parse_dataset_spec(bad)
    with pytest.raises(ValueError, match="dataset_path '/x' would apply to no entry"):
        parse_dataset_spec("a:1,b:1", "/x")


@pytest.mark.parametrize("flags, needle", [
    (["--training.dataset", "c4_test:0.7,c4_test_validation:0"], "training.dataset entry 'c4_test_validation:0'"),
    (["--training.dataset", "a:1,b:1", "--training.dataset_path", "/x"], "would apply to no entry"),
    (["--validation.dataset", "a:1,a:1"], "validation.dataset names 'a' twice"),
])
def test_config_refuses_a_bad_mix_in_one_line(flags, needle):
    with pytest.raises(ConfigError) as err:
        ConfigManager().parse_args(flags)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_draw_has_the_weights():
    n = 100_000
    share = sum(pick_source([0.7, 0.3], 0, j) == 0 for j in range(n)) / n
    assert abs(share - 0.7) < 0.01  # binomial sd 0.0014
    three = [pick_source([1, 2, 1], 5, j) for j in range(n)]
    assert [round(three.count(i) / n, 2) for i in range(3)] == [0.25, 0.5, 0.25]


def test_long_run_proportions_and_each_source_intact(spec):
    """4000 sequences: 0.7 / 0.3 within 0.03 (binomial sd 0.007); concatenating each source's
    sequences gives that source's own packed stream, documents in order, none skipped."""
    rows = _rows(_loader(spec, batch=8), 500)
    sources = [_source(r) for r in rows]
    share = sources.count("low") / len(rows)
    assert abs(share - 0.7) < 0.03, share
    alone = {
        name: _rows(_loader(spec.split(",")[k].rsplit(":", 1)[0] + ":1", batch=8), 500)
        for k, name in enumerate(("low", "up"))
    }
    for name in ("low", "up"):
        mine = [r for r, s in zip(rows, sources) if s == name]
        assert mine == alone[name][: len(mine)]


def test_deterministic_given_the_seed(spec):
    a, b = _rows(_loader(spec), 30), _rows(_loader(spec), 30)
    assert a == b
    other = [_source(r) for r in _rows(_loader(spec, seed=1), 30)]
    assert other != [_source(r) for r in a]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_exact_also_at_another_dp_degree(spec, workers):
    before, after_steps, global_batch = 5, 6, 4
    straight = sorted(
        row for r in range(2) for row in _rows(_loader(spec, r, 2, 2), before + after_steps)
    )
    loaders = [_loader(spec, r, 2, 2, workers=workers) for r in range(2)]
    consumed = [row for loader in loaders for row in _rows(loader, before)]
    states = [loader.state_dict() for loader in loaders]
    assert states[0] == states[1]
    state = pickle.loads(pickle.dumps(states[0]))
    for world in (1, 4):
        after = []
        for rank in range(world):
            loader = _loader(spec, rank, world, global_batch // world, workers=workers)
            loader.load_state_dict(state)
            after += _rows(loader, after_steps)
        assert sorted(consumed + after) == straight, f"dp 2 -> {world}"


def test_a_changed_mix_resumes_every_source_where_it_stopped(spec, caplog):
    import logging

    low = spec.split(",")[0].rsplit(":", 1)[0]
    only_low = _loader(f"{low}:1")
    rows = _rows(only_low, 3)
    state = only_low.state_dict()
    mixed = _loader(spec)
    with caplog.at_level(logging.INFO):
        mixed.load_state_dict(state)
        after = _rows(mixed, 10)
    assert "source up is new" in caplog.text and "the mix changed" in caplog.text
    low_after = [r for r in after if _source(r) == "low"]
    assert rows + low_after == _rows(_loader(f"{low}:1"), 3 + len(low_after) // 4 + 1)[
        : len(rows) + len(low_after)
    ]
