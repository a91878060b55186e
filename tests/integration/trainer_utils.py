"""Run the Trainer in-process on a tiny model and collect per-step losses."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from torchtitan.config.manager import ConfigManager
from torchtitan.train import Trainer

TINY = [
    "--job.config_file", "./train_configs/debug_model.toml",
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "64",
    "--training.local_batch_size", "4",
    "--training.steps", "4",
    "--activation_checkpoint.mode", "none",
    "--metrics.log_freq", "1",
    "--metrics.disable_color_printing",
    "--debug.seed", "0",
]


class RecordingTrainer(Trainer):
    """A Trainer that remembers (loss, grad_norm) of every step."""

    def __init__(self, job_config):
        super().__init__(job_config)
        self.history: list[tuple[float, float]] = []

    def train_step(self, data_iterator):
        result = super().train_step(data_iterator)
        # host copies of the step's device scalars
        self.history.append(None if result is None else (float(result[0]), float(result[1])))
        return result


def run_tiny(tmp_path, *flags: str) -> RecordingTrainer:
    cfg = ConfigManager().parse_args([*TINY, "--job.dump_folder", str(tmp_path), *flags])
    trainer = RecordingTrainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


@contextlib.contextmanager
def built_trainer(tmp_path, *flags: str, base: list[str] = TINY) -> Iterator[Trainer]:
    """A Trainer built from ``base`` + ``flags`` (dump folder ``tmp_path``), closed after;
    automatic garbage collection is back on afterwards (the trainer turns it off)."""
    cfg = ConfigManager().parse_args([*base, "--job.dump_folder", str(tmp_path), *flags])
    trainer = Trainer(cfg)
    try:
        yield trainer
    finally:
        trainer.close()
        gc.enable()
