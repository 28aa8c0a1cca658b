"""The config schema of a run and of the platform, Hydra composition, and the user's errors."""
