"""Train a clip_mini model: ``python train.py --config configs/tiny.yaml [--set key=value] [--resume]``."""
from clip_mini.cli.train import main

if __name__ == "__main__":
    raise SystemExit(main())
