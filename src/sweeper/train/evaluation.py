"""When a training run evaluates, what it scores, and when it has diverged."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection

import torch

from sweeper.config.schema import RunConfig
from sweeper.train.activations import ActivationWatch
from sweeper.train.data import val_window_count, val_windows
from sweeper.train.device import autocast_context


def is_eval_step(
    step: int, total_steps: int, eval_every: int, rung_steps: Collection[int] = ()
) -> bool:
    """Every eval_every steps, except less than half an interval before the end (the final
    evaluation would nearly repeat it; each costs ~4% of a CPU sweep trial), and at a
    sweep's `rung_steps`, where its scheduler decides, so a trial it stops trains nothing
    past the rung. The grid step that follows a rung within an interval is left out, so a
    run evaluates about as often."""
    if step in rung_steps:
        return True
    if step % eval_every or 2 * (total_steps - step) < eval_every:
        return False
    return not any(0 < step - rung < eval_every for rung in rung_steps)


# a step whose progress is this close under a rung is at it: rung fractions come back from
# the sweep's time axis through a division, and Ray's HyperBand rounds its units to 1e-9
RUNG_TOLERANCE = 1e-9


def rung_steps(rungs: Collection[float], step_fraction: float, total_steps: int) -> set[int]:
    """The first step at or past each rung, for a run whose every step moves it
    `step_fraction` of the sweep's budget along: where the scheduler first sees the trial
    there. Rungs the run never reaches are left out."""
    found = set()
    for rung in rungs:
        step = max(1, math.floor(rung / step_fraction))
        while step * step_fraction < rung * (1 - RUNG_TOLERANCE):
            step += 1
        if step < total_steps:
            found.add(step)
    return found


def evaluation_steps(
    cfg: RunConfig, total_steps: int, flops_per_token: int
) -> tuple[int, set[int]]:
    """(eval_every, the rung steps) of a run of `total_steps`: where is_eval_step
    evaluates it."""
    t = cfg.trainer
    # num_evals (sweeps) spreads a fixed number of evaluations over any run length
    eval_every = math.ceil(total_steps / t.num_evals) if t.num_evals else t.eval_every
    # how far along its budget each step moves the run, on the time axis a sweep's rungs use
    if t.budget_flops:
        step_fraction = t.total_batch_size * flops_per_token / t.budget_flops
    elif t.budget_tokens:
        step_fraction = t.total_batch_size / t.budget_tokens
    else:
        step_fraction = 1 / total_steps
    return eval_every, rung_steps(t.rungs, step_fraction, total_steps)


def evaluation_count(total_steps: int, eval_every: int, at_rungs: Collection[int]) -> int:
    """How many times a run evaluates: at each is_eval_step before its last step, and at
    its last (what a sweep's plan prices)."""
    between = range(1, total_steps)
    return 1 + sum(is_eval_step(step, total_steps, eval_every, at_rungs) for step in between)


class DivergenceWatch:
    """Tells a diverged run from one that spikes and recovers, one train loss at a time.

    A NaN/inf loss is a divergence at once. So is a loss over `max_loss` for `patience`
    steps in a row (low-LR runs that went on to learn spiked over 1.5 ln(V) for up to 6),
    and a loss at exactly ln(V) for `patience` steps in a row once it has been off it: a
    dead output, every logit equal, as AdamW at LR 30-100 fell to before its weights went
    NaN. A run that has never moved off ln(V) (a tiny LR) is left alone.
    """

    # a dead output gives ln(V) to ~1e-6; a live one is 2e-4 or more off it even at init
    UNIFORM_TOLERANCE = 2e-5
    MOVED = 0.1  # nats off ln(V): the run has learned something, or spiked

    def __init__(self, max_loss: float, patience: int, vocab_size: int) -> None:
        self.max_loss, self.patience = max_loss, patience
        self.uniform_loss = math.log(vocab_size)
        # steps in a row over the limit, and at a uniform guess
        self.over, self.uniform = 0, 0
        self.moved = False

    def check(self, loss: float, step: int) -> str | None:
        """The reason the run has diverged at this step, or None."""
        if not math.isfinite(loss):
            return f"train loss {loss:.4g} at step {step}"
        off = abs(loss - self.uniform_loss)
        self.moved = self.moved or off > self.MOVED
        self.over = self.over + 1 if loss > self.max_loss else 0
        self.uniform = self.uniform + 1 if self.moved and off < self.UNIFORM_TOLERANCE else 0
        steps = max(self.over, self.uniform)
        if steps < self.patience:
            return None
        what = f"over the limit {self.max_loss:.3g}" if self.over else "a uniform guess"
        return f"train loss {loss:.4g} at step {step} ({what}" + (
            f" for {steps} steps)" if steps > 1 else ")"
        )


@torch.no_grad()
def evaluate(
    model,
    data,
    cfg: RunConfig,
    device,
    dtype,
    rank: int,
    world: int,
    watch: ActivationWatch | None = None,
) -> float:
    """Validation bits per byte (bits per token when bytes_per_token is unknown). With a
    `watch`, the activations of this rank's first batch are recorded in `watch.stats`."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of nats, tokens)
    batches = val_windows(
        data.val, cfg.model.seq_len, cfg.trainer.eval_tokens, cfg.trainer.device_batch_size
    )
    first = None
    for i, (x, y) in enumerate(batches):
        if i % world != rank:  # DDP: each rank scores its share, then all-reduce
            continue
        recording = watch is not None and first is None
        if first is None:
            first = x
        with (
            watch.recording() if recording else contextlib.nullcontext(),
            autocast_context(device, dtype),
        ):
            loss = model(x.to(device), y.to(device), reduction="sum")
        total += torch.stack([loss.double(), torch.tensor(y.numel(), device=device).double()])
    if watch is not None and not watch.stats and first is not None:
        # the pass went through a compiled graph, which the hooks do not reach: one eager
        # forward of the tokens the figures read (on a GPU, a few ms a report)
        with autocast_context(device, dtype):
            watch.record(first.to(device))
    if world > 1:
        torch.distributed.all_reduce(total)
    model.train()
    nats_per_token = (total[0] / total[1]).item()
    return nats_per_token / math.log(2) / (data.bytes_per_token or 1.0)


def data_notes(data, cfg) -> list[str]:
    """What the evaluation's figure is, where it is not what its name says or asks."""
    notes = []
    seq_len, asked = cfg.model.seq_len, cfg.trainer.eval_tokens
    windows = val_window_count(data.val.size, seq_len, asked)
    if windows < max(1, asked // seq_len):
        notes.append(
            f"each evaluation scores {windows * seq_len:,} tokens, not trainer.eval_tokens={asked:,}: "
            f"the validation split holds {data.val.size:,}"
        )
    if data.bytes_per_token is None:
        notes.append(
            "val bpb here is bits per token (data.bytes_per_token=null); set it to the "
            "corpus's average bytes per token for bits per byte"
        )
    return notes
