"""The ``lilicorr`` command: LightningCLI (``fit``/``validate``/``test``/``predict``) plus tools.

``lilicorr fit -c configs/tiny.yaml`` trains; ``lilicorr fit -c base.yaml -c configs/ablations/no_distractor.yaml``
ablates by overlay; ``lilicorr fit -c base.yaml --print_config`` shows the resolved config. The tool
subcommands (``demo``, ``bench``, ``regenerate``, ``export``, ``build-target``) have their own ``--help``.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger

from lilicorr_pl.data.datamodule import DraftDataModule
from lilicorr_pl.system import DraftSystem

TOOLS = {
    "demo": ("lilicorr_pl.demo.run", "build a small target, train DFlash + LiLiCorr, compare arms"),
    "bench": ("lilicorr_pl.bench", "real speculative-decoding benchmark of a trained checkpoint"),
    "regenerate": ("lilicorr_pl.data.regenerate", "regenerate responses with the target (resumable)"),
    "export": ("lilicorr_pl.interop", "export a drafter in the z-lab DFlash Hugging Face layout"),
    "build-target": ("lilicorr_pl.demo.tiny_target", "build the built-in tiny stdlib target"),
}


def git_commit() -> str | None:
    """The current git commit of the working directory, if any (recorded with every run)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


class LoggerSaveConfigCallback(SaveConfigCallback):
    """Writes ``config.yaml`` as usual and records the resolved config and git commit in W&B."""

    def save_config(self, trainer: Any, pl_module: Any, stage: str) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                config = self.parser.dump(self.config, skip_none=False, format="yaml")
                import yaml

                logger.experiment.config.update(
                    {"lilicorr_config": yaml.safe_load(config), "git_commit": git_commit(), "stage": stage},
                    allow_val_change=True,
                )


class LilicorrCLI(LightningCLI):
    """LightningCLI with the links that keep model and data consistent."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The data module tokenizes with, and precomputes logits from, the model's target.
        parser.link_arguments("model.target", "data.target", apply_on="parse")
        parser.link_arguments("data.max_length", "model.max_length", apply_on="parse")

    def before_fit(self) -> None:
        self._wire_data()

    def before_validate(self) -> None:
        self._wire_data()

    def before_test(self) -> None:
        self._wire_data()

    def _wire_data(self) -> None:
        dm = self.datamodule
        if isinstance(dm, DraftDataModule) and isinstance(self.model, DraftSystem):
            # The logit cache is only worth computing when an active loss reads target logits.
            dm.require_logit_cache(self.model.needs_logit_cache(offline_features=dm.feature_cache))


def _run_tool(name: str, argv: list[str]) -> Any:
    module = importlib.import_module(TOOLS[name][0])
    return module.main(argv)


def main(args: Sequence[str] | None = None) -> Any:
    """Entry point of ``lilicorr`` and ``python -m lilicorr_pl``; tests call it with an argument list."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] in TOOLS:
        result = _run_tool(argv[0], argv[1:])
        # From the console, a tool's return value is data, not an exit status.
        if args is not None:
            return result
        return result if isinstance(result, int) else None  # an int is the tool's exit status
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cli = LilicorrCLI(
        DraftSystem,
        DraftDataModule,
        args=argv if args is not None else None,
        parser_kwargs={
            "parser_mode": "omegaconf",
            "description": (__doc__ or "") + "\nTools: " + ", ".join(f"{k} ({v[1]})" for k, v in TOOLS.items()),
        },
        save_config_callback=LoggerSaveConfigCallback,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )
    return cli if args is not None else None


if __name__ == "__main__":  # pragma: no cover
    main()
