"""Settings that some layout would accept and then not use are refused or made to act.

Refusals go through ``python -m torchtitan.config_manager`` in-process (the pre-flight the
launcher runs): one ``error:`` line, exit code 2.
"""

from __future__ import annotations

import pytest

from tests.conftest import REPO_ROOT
from torchtitan.config.manager import main

DEBUG = str(REPO_ROOT / "train_configs" / "debug_model.toml")
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--world_size", "2")


def refusal(capsys, *flags: str) -> str:
    """The one ``error:`` line the pre-flight prints for ``flags`` (exit code 2)."""
    code = main(["--job.config_file", DEBUG, *flags])
    out = capsys.readouterr()
    assert (code, out.out) == (2, ""), out.err
    assert len(out.err.splitlines()) == 1 and out.err.startswith("error: "), out.err
    return out.err


def accepted(capsys, *flags: str) -> None:
    code = main(["--job.config_file", DEBUG, *flags])
    assert code == 0, capsys.readouterr().err


# --- pipeline: a setting the chosen cut or schedule does not use -----------------------------
@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--parallelism.pipeline_parallel_split_points", "layers.3",
          "--parallelism.pipeline_parallel_first_stage_less_layers", "0"],
         "parallelism.pipeline_parallel_first_stage_less_layers=0 is not used: "
         "parallelism.pipeline_parallel_split_points lists each stage's modules; drop it"),
        (["--parallelism.module_fqns_per_model_part",
          "tok_embeddings,layers.0,layers.1,layers.2;layers.3,layers.4,layers.5,norm,output",
          "--parallelism.pipeline_parallel_last_stage_less_layers", "2"],
         "parallelism.pipeline_parallel_last_stage_less_layers=2 is not used: "
         "parallelism.module_fqns_per_model_part lists each stage's modules"),
    ],
)
def test_stage_size_offsets_beside_listed_stages_are_refused(capsys, flags, needle):
    assert needle in refusal(capsys, *PP2, *flags)


def test_listed_stages_with_default_offsets_are_accepted(capsys):
    accepted(capsys, *PP2, "--parallelism.pipeline_parallel_split_points", "layers.3")


def test_a_named_schedule_beside_a_csv_schedule_is_refused(capsys, tmp_path):
    path = tmp_path / "sched.csv"
    path.write_text("0F0,0B0\n1F0,1B0\n")
    csv = ("--parallelism.pipeline_parallel_schedule_csv", str(path))
    message = refusal(capsys, *PP2, *csv, "--parallelism.pipeline_parallel_schedule", "GPipe")
    assert "parallelism.pipeline_parallel_schedule='GPipe' is not used: " \
           "pipeline_parallel_schedule_csv gives the schedule; drop one of them" in message
