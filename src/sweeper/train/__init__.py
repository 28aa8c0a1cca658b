"""The training side: the GPT, its optimizer, data, the loop, checkpoints and DDP.

`sweeper.train.train` is the default `trainable._target_`: sweeper's own training run.
"""


def train(config, report=None, **kwargs):
    """One training run of `config` (see `sweeper.train.loop.train`); torch is imported here,
    not when the package is."""
    from sweeper.train.loop import train as run

    return run(config, report, **kwargs)
