"""One GPT training run: `train(config, report)`.

The same function serves `python -m sweeper` (one run, in-process) and every trial of a
sweep (called inside a Ray worker with a plain dict). It reads top to bottom:
setup -> budget -> loop (accumulate, clip, step, check divergence, log, evaluate + report)
-> result. `report(metrics)` is called at every evaluation; when the trainer is asked to
checkpoint, it is also given `state=` a function returning the full resumable state.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from sweeper.config.errors import ConfigError
from sweeper.config.schema import RunConfig, load_run_config
from sweeper.train.activations import ActivationWatch, activations_text
from sweeper.train.budget import resolve_total_steps
from sweeper.train.data import BatchSampler, load_data, unigram_bpb, val_window_count, val_windows
from sweeper.train.device import (
    autocast_context,
    distributed_info,
    keep_freed_memory_for_reuse,
    peak_flops,
    peak_memory_bytes,
    release_freed_memory,
    reset_peak_memory,
    resolve_device,
    resolve_dtype,
    utilization,
)
from sweeper.train.model import GPT, GPTShape, residual_dtype_for
from sweeper.train.optim import build_optimizer, update_ratios, weights_before_step
from sweeper.train.schedule import lr_multiplier, muon_momentum, weight_decay_multiplier

Report = Callable[..., Any]


def is_eval_step(
    step: int, total_steps: int, eval_every: int, rung_steps: Collection[int] = ()
) -> bool:
    """Every eval_every steps, except one less than half an interval before the end: the
    final evaluation follows it at once and would nearly repeat it (25 steps every 4 would
    evaluate at 24 and 25; each evaluation costs ~4% of a sweep trial on a CPU).

    And at a sweep's rungs (`rung_steps`, see rung_steps): its scheduler decides there, so
    a trial it stops or pauses trains nothing past the rung, where on the grid alone a
    trial of 25 steps with a rung at a third (8.3) went on to step 12. The grid step that
    follows a rung within an interval is left out, so a run evaluates about as often."""
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
    steps in a row, and a loss at exactly ln(V) for `patience` steps in a row once it has
    been off it: a dead output, every logit equal, guessing uniformly. Both were measured on
    the search bench's model: runs of its low-LR corner went over 1.5 ln(V) for 1-5 steps
    (AMD EPYC) or 3-6 (Intel Xeon with AVX-512) and went on to learn, while AdamW at LR 30
    or 100 went over the limit for a few steps, then fell to ln(V), under the limit, and
    stayed there until its weights went NaN (LR 100: at step 18, its 14th at ln(V)). A run
    that has never moved off ln(V) (a tiny LR) is left alone.
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


def train(
    config: Mapping | RunConfig,
    report: Report | None = None,
    *,
    resume_state: dict | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    # --- setup ---------------------------------------------------------------------------
    cfg = load_run_config(config)
    t = cfg.trainer
    rank, world, local_rank = distributed_info()
    if world != t.workers:
        # each step accumulates for trainer.workers ranks' share of the batch: on fewer
        # ranks it would train part of the batch and log all of it
        raise ConfigError(
            f"trainer.workers={t.workers}, but this process is one of {world} rank"
            f"{'s' * (world != 1)}: run it through `python -m sweeper` (Ray Train starts the"
            " ranks) or set trainer.workers to the process group's size"
        )
    device = resolve_device(t.device, local_rank)
    dtype = resolve_dtype(t.dtype, device)
    if t.threads:
        torch.set_num_threads(t.threads)
    if device.type == "cpu":
        release_freed_memory()  # of earlier runs in this (reused Ray) worker
        keep_freed_memory_for_reuse()
    reset_peak_memory(device)  # after the release: an earlier run's peak is not this one's
    say = print if verbose and rank == 0 else (lambda *a, **k: None)

    torch.manual_seed(t.seed)
    data = load_data(cfg.data, cfg.model.seq_len)
    model = GPT(GPTShape.from_config(cfg.model), residual_dtype_for(device, dtype)).to(device)
    counts, flops_per_token = model.param_counts(), model.flops_per_token()
    total_steps = resolve_total_steps(cfg, counts["total"], flops_per_token)
    optimizer = build_optimizer(model, cfg.optimizer)
    sampler = BatchSampler(data.train, t.device_batch_size, cfg.model.seq_len, t.seed, rank, world)
    accum = cfg.grad_accum_steps
    eval_every, at_rungs = evaluation_steps(cfg, total_steps, flops_per_token)
    tokens_per_step = t.total_batch_size
    max_loss = t.max_loss or 1.5 * math.log(cfg.model.vocab_size)

    step, history, loss_trace = 0, [], []
    if resume_state is not None:
        # taken out of the caller's dict as they are loaded: kept there, a resumed run held
        # a second copy of its weights (and, on a GPU, of Muon's and AdamW's state) to its end
        model.load_state_dict(resume_state.pop("model"))
        optimizer.load_state_dict(resume_state.pop("optimizer"))
        for group in optimizer.param_groups:  # a checkpoint from before the decay's schedule
            group.setdefault("initial_weight_decay", group["weight_decay"])  # held it constant
        torch.set_rng_state(resume_state["torch_rng"])
        step, history = resume_state["step"], list(resume_state["history"])
        loss_trace = list(resume_state["loss_trace"])
    divergence = DivergenceWatch(max_loss, t.max_loss_patience, cfg.model.vocab_size)
    for past_step, past_loss in enumerate(loss_trace, 1):  # a resumed run's streaks go on
        divergence.check(past_loss, past_step)

    train_model = model
    use_compile = t.compile == "true" or (t.compile == "auto" and device.type == "cuda")
    if use_compile:
        train_model = torch.compile(model, dynamic=False)
    if world > 1:
        train_model = torch.nn.parallel.DistributedDataParallel(
            train_model, device_ids=[local_rank] if device.type == "cuda" else None
        )
    peak = peak_flops(device, dtype)
    say(
        f"model: {counts['total'] / 1e6:.2f}M params ({counts['matmul'] / 1e6:.2f}M matmul), "
        f"{flops_per_token / 1e6:.1f} MFLOP/token | {data.description}\n"
        f"run: {total_steps} steps x {tokens_per_step} tokens (accum {accum}, workers {world}) "
        f"on {device.type} {str(dtype).removeprefix('torch.')}"
        f"{' compiled' if use_compile else ''}"
    )
    for note in data_notes(data, cfg):
        say(f"note: {note}")
    if step:
        say(f"resumed at step {step}/{total_steps} from a checkpoint")

    def training_state() -> dict:
        # live tensors, not copies: the caller serialises them before training goes on
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "step": step,
            "history": list(history),
            "loss_trace": list(loss_trace),
        }

    params = list(model.parameters())
    watch = ActivationWatch(model)  # read at each evaluation

    most_memory = 0.0  # bytes: the largest reading so far

    def peak_memory_gib() -> float | None:
        """The run's peak memory so far (runtime.peak_memory_bytes); with DDP the largest
        rank's, which is what has to fit. The largest reading yet: the kernel's high-water
        mark is kept lazily and a later reading came out 0.2 MiB lower in a CI run."""
        nonlocal most_memory
        held = peak_memory_bytes(device)
        if held is None:
            return None
        if world > 1:
            largest = torch.tensor(float(held), device=device)
            torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
            held = largest.item()
        most_memory = max(most_memory, held)
        return most_memory / 2**30

    def optimizer_step(
        batch_step: int, lrm: float, wdm: float, momentum: float, measure: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """One optimizer step on the batches of step `batch_step`: the summed micro-batch
        losses, the gradient's global norm before clipping (tensors: no device sync) and,
        if `measure`, how far the step moved each parameter group (`update_ratios`; the
        weights are copied after the backward pass, so the copy never adds to the
        activations' peak). Also a cooldown fork's step (below), with its own LR."""
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            group["weight_decay"] = group["initial_weight_decay"] * wdm
            if "nesterov" in group:  # Muon's group
                group["momentum"] = momentum
        # forward/backward over micro-batches; DDP all-reduces only on the last one
        loss_sum = torch.zeros((), device=device)
        for micro, (x, y) in enumerate(sampler.step_batches(batch_step, accum, device)):
            sync = world == 1 or micro == accum - 1
            with (
                contextlib.nullcontext() if sync else train_model.no_sync(),
                autocast_context(device, dtype),
            ):
                loss = train_model(x, y)
                if batch_step + 1 == t.nan_at_step:  # injected fault: NaN gradients and weights
                    loss = loss * float("nan")
            (loss / accum).backward()
            loss_sum += loss.detach()
        if t.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        else:  # unclipped, the norm is still worth watching: spikes come before loss spikes
            grads = [p.grad for p in params if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads)
        before = weights_before_step(optimizer) if measure else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm, update_ratios(optimizer, before) if before else {}

    def cooled_val_bpb(lrm: float, wdm: float, momentum: float) -> tuple[float, int]:
        """val_bpb of a copy of the run cooled down from here, and the fork's steps.

        Under WSD a run at its peak LR scores worse than it will after its decay, the more
        so the higher the LR: a rung that ranks runs as they are stops high-LR runs that
        would have won. The fork decays the LR linearly to the schedule's final value over
        `rung_cooldown` x the steps so far, on the batches the run is about to see, is
        evaluated, and is thrown away: model, optimizer and RNG go back exactly as they
        were. Written here: torch has no fork of a training state, and the eighth session's
        measurements (BENCHMARKS.md) ranked runs best this way (rho 0.94 against 0.86).
        """
        steps = max(1, round(t.rung_cooldown * step))
        kept = {
            "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(optimizer.state_dict()),
            "rng": torch.get_rng_state(),
        }
        try:
            # the weight decay, too, goes where the schedule ends it (linear: to 0)
            final, final_wd = cfg.scheduler.final_lr_frac, weight_decay_at(total_steps)
            for i in range(steps):
                # each step at the middle of its own span of the decay: the last is not at the
                # final LR (0 under WSD: a step that moves nothing, paid for all the same),
                # and a one-step fork still cools
                done = (i + 0.5) / steps
                optimizer_step(
                    step + i, lrm + (final - lrm) * done, wdm + (final_wd - wdm) * done, momentum
                )
            value = evaluate(
                train_model if world == 1 else model, data, cfg, device, dtype, rank, world
            )
        finally:
            model.load_state_dict(kept["model"])
            optimizer.load_state_dict(kept["optimizer"])
            torch.set_rng_state(kept["rng"])
        return value, steps

    def weight_decay_at(at_step: int) -> float:
        return weight_decay_multiplier(at_step, total_steps, cfg.optimizer.weight_decay_schedule)

    # --- loop ----------------------------------------------------------------------------
    status, reason, val_bpb, train_loss = "completed", None, None, float("nan")
    if history:  # resumed: a checkpoint of the last step leaves nothing to train
        val_bpb, train_loss = history[-1]["val_bpb"], history[-1]["train_loss"]
    train_seconds, window_tokens, window_start = 0.0, 0, time.perf_counter()
    tok_s, mfu, start_step = 0.0, None, step
    timed_from = start_step  # train_seconds times the steps after this one
    # the largest gradient norm since the last report: a spike between evaluations shows
    grad_norm_max: torch.Tensor | None = None
    fork_steps_ahead = sorted(s for s in at_rungs if s > step) if t.rung_cooldown else []
    # training FLOPs of the cooldown forks so far: compute the sweep spent, though not the
    # run's own (its `flops`, the scaling fits' axis, leaves them out)
    fork_flops = history[-1].get("fork_flops", 0.0) if history else 0.0
    try:
        while step < total_steps:
            # 1) schedule: LR multiplier on every group's peak, Muon momentum warm-up
            lrm = lr_multiplier(
                step,
                total_steps,
                cfg.scheduler.name,
                cfg.scheduler.warmup_ratio,
                cfg.scheduler.warmdown_ratio,
                cfg.scheduler.final_lr_frac,
            )
            momentum = muon_momentum(
                step,
                cfg.optimizer.muon_momentum_start,
                cfg.optimizer.muon_momentum,
                cfg.optimizer.muon_momentum_warmup,
            )
            # 2) forward/backward over the micro-batches, clip, step; before a report, how
            # far the step moves the weights (a copy of them: only then, it is not free)
            reports_next = step + 1 == total_steps or is_eval_step(
                step + 1, total_steps, eval_every, at_rungs
            )
            wdm = weight_decay_at(step)
            loss_sum, grad_norm, ratios = optimizer_step(step, lrm, wdm, momentum, reports_next)
            # maximum, not fmax: a NaN norm is the news, and must not be skipped over
            grad_norm_max = (
                grad_norm if grad_norm_max is None else torch.maximum(grad_norm_max, grad_norm)
            )
            if world > 1:
                torch.distributed.all_reduce(loss_sum, op=torch.distributed.ReduceOp.AVG)
            train_loss = loss_sum.item() / accum
            loss_trace.append(train_loss)
            step += 1
            window_tokens += tokens_per_step
            # 3) divergence fast-fail: NaN at once; over the limit or dead for the patience
            reason = divergence.check(train_loss, step)
            if reason:
                status = "diverged"
                say(f"step {step}: diverged: {reason}")
            if step == start_step + 1:
                # long-lived objects are made by now; freezing them spares the GC ~0.5 s pauses
                gc.collect()
                gc.freeze()
                if step < total_steps and status != "diverged":
                    # throughput excludes this first step (compilation and allocator warm-up)
                    # when another step follows to be timed instead
                    window_tokens, window_start = 0, time.perf_counter()
                    timed_from = step
            now = time.perf_counter()
            last = step == total_steps or status == "diverged"
            # 4) progress line
            if step % t.log_every == 0 or last:
                elapsed = now - window_start
                train_seconds += elapsed
                tok_s = window_tokens / max(elapsed, 1e-9)
                eta = (total_steps - step) * train_seconds / max(step - timed_from, 1)
                mfu = utilization(flops_per_token, tok_s, peak, world)
                say(
                    f"step {step:5d}/{total_steps} | loss {train_loss:.4f} | "
                    f"grad norm {grad_norm.item():.3f} | lr x{lrm:.3f} | "
                    f"{tok_s:,.0f} tok/s | mfu {f'{100 * mfu:.1f}%' if mfu else '-'} | "
                    f"eta {eta:.0f}s"
                )
                window_tokens, window_start = 0, time.perf_counter()
            # 5) evaluate (and, at a sweep's rung, a cooled-down fork) and report
            if last or is_eval_step(step, total_steps, eval_every, at_rungs):
                eval_start = time.perf_counter()
                if status == "diverged":
                    val_bpb = float("nan")
                else:
                    evaluated = train_model if world == 1 else model
                    val_bpb = evaluate(evaluated, data, cfg, device, dtype, rank, world, watch)
                    moved = ", ".join(f"{name} {ratio:.1e}" for name, ratio in ratios.items())
                    say(
                        f"step {step:5d}/{total_steps} | val bpb {val_bpb:.4f}"
                        + (f" | update/weight {moved}" if moved else "")
                        + (f" | {activations_text(watch.stats)}" if watch.stats else "")
                    )
                rung_val_bpb = val_bpb
                at_rung = bool(fork_steps_ahead) and step >= fork_steps_ahead[0]
                while fork_steps_ahead and step >= fork_steps_ahead[0]:
                    fork_steps_ahead.pop(0)
                if at_rung and not last:
                    cooled, fork_steps = cooled_val_bpb(lrm, wdm, momentum)
                    fork_flops += fork_steps * tokens_per_step * flops_per_token
                    if math.isfinite(cooled):  # a fork that blew up says nothing of the run
                        rung_val_bpb = cooled
                    say(
                        f"step {step:5d}/{total_steps} | val bpb {cooled:.4f} after a "
                        f"{fork_steps}-step cooldown fork (a rung)"
                    )
                tokens = step * tokens_per_step
                metrics = {
                    "step": step,
                    "tokens": tokens,
                    "flops": tokens * flops_per_token,
                    # N of the scaling fits: a sweep's reports are all they read
                    "params": counts["total"],
                    "train_loss": train_loss,
                    "val_bpb": val_bpb,
                    "lr": lrm * cfg_peak_lr(cfg),
                    # before clipping, at this step and the largest since the last report
                    "grad_norm": grad_norm.item(),
                    "grad_norm_max": grad_norm_max.item(),
                    # ||step's update|| / ||weights|| per parameter group (update_ratios)
                    **{f"update_ratio_{name}": ratio for name, ratio in ratios.items()},
                    # MLP units off and dead, the residual stream's size, the soft-cap's
                    # saturation (activations.py); none for a diverged run, not evaluated
                    **(watch.stats if status != "diverged" else {}),
                    "tokens_per_s": tok_s,
                    "mfu": mfu,
                    "peak_memory_gib": peak_memory_gib(),
                    "status": status if last else "running",
                }
                if t.rung_cooldown:  # what the sweep's rungs rank: see cooled_val_bpb
                    metrics["rung_val_bpb"] = rung_val_bpb
                    metrics["fork_flops"] = fork_flops
                if reason:
                    metrics["reason"] = reason
                history.append(metrics)
                grad_norm_max = None
                if report is not None:
                    if t.checkpoint_every_eval and status != "diverged":
                        report(metrics, state=training_state)
                    else:
                        report(metrics)
                # evaluation (and checkpointing) is not training time: the window's clock skips
                # it, and keeps the training steps before it in this log window
                window_start += time.perf_counter() - eval_start
            if status == "diverged":
                break
    finally:
        # also when Tune stops the trial (an exception raised inside this loop): a reused
        # Ray worker must not keep this run's objects frozen, out of the collector's reach
        gc.unfreeze()

    # --- result --------------------------------------------------------------------------
    tokens = step * tokens_per_step
    timed_steps = step - timed_from
    # a run resumed at its last step trains nothing here: it has no speed to report
    overall_tok_s = (
        timed_steps * tokens_per_step / train_seconds if timed_steps and train_seconds else None
    )
    return {
        "status": status,
        **({"reason": reason} if reason else {}),
        "val_bpb": val_bpb,
        "train_loss": train_loss,
        "tokens": tokens,
        "flops": tokens * flops_per_token,
        "params": counts["total"],
        "params_matmul": counts["matmul"],
        "params_non_embedding": counts["non_embedding"],
        "flops_per_token": flops_per_token,
        "tokens_per_s": overall_tok_s,
        "mfu": utilization(flops_per_token, overall_tok_s, peak, world) if overall_tok_s else None,
        "peak_memory_gib": peak_memory_gib(),
        "steps": step,
        "workers": world,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device.type,
        "train_seconds": train_seconds,
        "unigram_bpb": unigram_bpb(data),
        "history": history,
        "loss_trace": loss_trace,
    }


def cfg_peak_lr(cfg: RunConfig) -> float:
    """The headline peak LR reported as `lr`: Muon's matrix LR, or AdamW's single LR."""
    return cfg.optimizer.lr if cfg.optimizer.name == "adamw" else cfg.optimizer.matrix_lr
