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

from lilicorr_pl.checkpoint import CheckpointError, UserInputError, check_class_paths, read_checkpoint
from lilicorr_pl.data.datamodule import DraftDataModule
from lilicorr_pl.system import DraftSystem, check_resume_settings, plain_data

TOOLS = {
    "demo": ("lilicorr_pl.demo.run", "build a small target, train DFlash + LiLiCorr, compare arms"),
    "bench": ("lilicorr_pl.bench", "real speculative-decoding benchmark of a trained checkpoint"),
    "regenerate": ("lilicorr_pl.data.regenerate", "regenerate responses with the target (resumable)"),
    "export": ("lilicorr_pl.interop", "export a drafter in the z-lab DFlash Hugging Face layout"),
    "build-target": ("lilicorr_pl.demo.tiny_target", "build the built-in tiny stdlib target"),
}


# Lightning's ckpt_path keywords (not files).
CKPT_SHORTCUTS = ("last", "best", "hpc", "registry")


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

    def _parse_ckpt_path(self) -> None:
        """Check a ``ckpt_path`` before anything is built, without letting it override the command line.

        LightningCLI's own version loads the checkpoint's hyperparameters over the user's config, so a resume
        with another head, target or ``num_anchors`` silently ran with the checkpoint's. Here the checkpoint is
        opened weights-only (a pickled payload, a truncated file or untrusted components get one line), and its
        settings are compared with this run's: weights-defining keys must agree, the rest is applied and shown.
        """
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        ckpt = self.config[subcommand].get("ckpt_path")
        if not ckpt or (str(ckpt) in CKPT_SHORTCUTS and not os.path.exists(str(ckpt))):
            return
        checkpoint = read_checkpoint(ckpt, verify=False)  # the checksum is verified when Lightning restores it
        saved = checkpoint.get("hyper_parameters") or {}
        check_class_paths(saved, ckpt)
        del checkpoint
        current = plain_data(self.config[subcommand].get("model"))
        if subcommand == "fit":
            # The comparison runs again in DraftSystem.on_load_checkpoint (there the changes are printed).
            check_resume_settings(saved, current)

    def instantiate_classes(self) -> None:
        # Constructors validate their settings (before any heavy work); a bad value is the user's to fix, so it
        # becomes one line, not a 70-line traceback. Errors after this point keep their tracebacks.
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as err:
            while err.__cause__ is not None and isinstance(err.__cause__, (ValueError, TypeError)):
                err = err.__cause__
            raise UserInputError(str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)) from None

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if "weights_only" in self._subcommand_method_arguments[subcommand]:
            if kwargs.get("weights_only") is False:
                raise CheckpointError("--weights_only=false is refused: checkpoints are always opened weights-only")
            kwargs["weights_only"] = True  # never unpickle objects from a checkpoint, whatever torch's env flag says
        return kwargs

    def before_validate(self) -> None:
        self._wire_data()

    def before_test(self) -> None:
        self._wire_data()

    def _wire_data(self) -> None:
        dm = self.datamodule
        if isinstance(dm, DraftDataModule) and isinstance(self.model, DraftSystem):
            # The logit cache is only worth computing when an active loss reads target logits.
            dm.require_logit_cache(self.model.needs_logit_cache(offline_features=dm.feature_cache))
            self.model.check_offline_features(dm.feature_cache)


def _run_tool(name: str, argv: list[str]) -> Any:
    module = importlib.import_module(TOOLS[name][0])
    return module.main(argv)


def main(args: Sequence[str] | None = None) -> Any:
    """Entry point of ``lilicorr`` and ``python -m lilicorr_pl``; tests call it with an argument list."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] == "prepare":
        return _prepare(argv[1:])
    if argv and argv[0] in TOOLS:
        result = _run_tool(argv[0], argv[1:])
        # From the console, a tool's return value is data, not an exit status.
        if args is not None:
            return result
        return result if isinstance(result, int) else None  # an int is the tool's exit status
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        cli = _make_cli(argv if args is not None else None)
    except UserInputError as err:
        # A user's mistake or an unsafe file: one line naming the problem and the fix, not a traceback.
        print(f"lilicorr: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return cli if args is not None else None


def _prepare(argv: list[str]) -> Any:
    """``lilicorr prepare -c config.yaml``: the training config's data module, precomputed with the devices of
    its ``trainer`` section (``--trainer.devices=8`` overrides) by ``lilicorr_pl.data.prepare.prepare``."""
    import torch
    from jsonargparse import Namespace, namespace_to_dict

    from lilicorr_pl.data.prepare import prepare

    class PrepareCLI(LilicorrCLI):
        def instantiate_classes(self) -> None:
            # The data module, and the system on the meta device (no weights, no warm starts) only to ask which
            # stores the fit will read, as `fit` does; no trainer or logger is built.
            model = self.config["model"].clone()
            model.init_drafter_from = model.init_head_from = None
            model.init_drafter_layers_from_target = False
            parser = LightningArgumentParser(parser_mode="omegaconf")
            parser.add_lightning_class_args(DraftSystem, "model", subclass_mode=False)
            try:
                self.datamodule = DraftDataModule(**namespace_to_dict(self.config["data"]))
                with torch.device("meta"):
                    system = parser.instantiate_classes(Namespace(model=model)).model
            except (ValueError, TypeError) as err:
                raise UserInputError(str(err).strip().splitlines()[-1]) from None
            self.datamodule.require_logit_cache(system.needs_logit_cache(offline_features=self.datamodule.feature_cache))

    try:
        cli = PrepareCLI(DraftSystem, DraftDataModule, args=argv, run=False, save_config_callback=None,
                         auto_configure_optimizers=False,
                         parser_kwargs={"parser_mode": "omegaconf", "description": _prepare.__doc__})
        trainer = cli.config["trainer"]
        return prepare(cli.datamodule, accelerator=trainer["accelerator"], devices=trainer["devices"],
                       num_nodes=trainer["num_nodes"])
    except UserInputError as err:
        print(f"lilicorr: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _make_cli(args: list[str] | None) -> LilicorrCLI:
    return LilicorrCLI(
        DraftSystem,
        DraftDataModule,
        args=args,
        parser_kwargs={
            "parser_mode": "omegaconf",
            "description": (__doc__ or "") + "\nTools: prepare (precompute the data module's caches on every device), "
            + ", ".join(f"{k} ({v[1]})" for k, v in TOOLS.items()),
        },
        save_config_callback=LoggerSaveConfigCallback,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":  # pragma: no cover
    main()
