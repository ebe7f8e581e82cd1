"""Training engine: ``train(cfg)`` and its parts (optimiser groups, accumulation, checkpoints, evaluation).

    from clip_mini.config import load_config
    from clip_mini.train import train
    result = train(load_config("configs/tiny.yaml", ["train.epochs=3"]))

Command line: ``python train.py --config configs/tiny.yaml [--set key=value ...] [--resume [auto|PATH]]``,
or the same flags after ``clip-mini train``; ``torchrun --nproc_per_node=N train.py ...`` runs distributed.
"""
from clip_mini.train.build import TrainError
from clip_mini.train.checkpoint import CheckpointError, load_checkpoint
from clip_mini.eval.validation import evaluate_model
from clip_mini.train.loop import train

__all__ = ["train", "evaluate_model", "TrainError", "CheckpointError", "load_checkpoint"]
