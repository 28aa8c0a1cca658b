"""sweeper: hyperparameter sweeps for GPT pretraining (Hydra + Ray Tune + MLflow)."""

__version__ = "0.1.0"
