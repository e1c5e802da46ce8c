"""Command-line entry point: ``python train.py fit --config configs/quickstart.yaml``.

A LightningCLI with the FederatedLoop as model and any FederatedDataModule as data (``class_path`` of your own
modules works too). Subcommands: fit, validate, test, predict.
"""

from fedlightning.cli import main

if __name__ == "__main__":
    main()
