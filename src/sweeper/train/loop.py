"""One GPT training run: `train(config, report)`, for `python -m sweeper` and for every
trial of a sweep (inside a Ray worker, with a plain dict). `report(metrics)` is called at
every evaluation; with checkpoints on it also gets `state=`, a function returning the full
resumable state.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from sweeper.config.errors import ConfigError
from sweeper.config.schema import RunConfig, load_run_config
from sweeper.train.activations import ActivationWatch, activations_text
from sweeper.train.budget import resolve_total_steps
from sweeper.train.cpu_fast import keep_freed_memory_for_reuse, ops_for, release_freed_memory
from sweeper.train.data import BatchSampler, load_data, unigram_bpb
from sweeper.train.device import (
    autocast_context,
    distributed_info,
    peak_flops,
    peak_memory_bytes,
    reset_peak_memory,
    resolve_device,
    resolve_dtype,
    utilization,
)
from sweeper.train.evaluation import (
    DivergenceWatch,
    data_notes,
    evaluate,
    evaluation_steps,
    is_eval_step,
)
from sweeper.train.model import GPT, GPTShape, residual_dtype_for
from sweeper.train.optim import build_optimizer, update_ratios, weights_before_step
from sweeper.train.schedule import lr_multiplier, muon_momentum, weight_decay_multiplier

Report = Callable[..., Any]


def train(
    config: Mapping | RunConfig,
    report: Report | None = None,
    *,
    resume_state: dict | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Train the GPT `config` describes; returns the run's result (status, val_bpb, tokens,
    flops, throughput, the history of its reports)."""
    run = Run(load_run_config(config), verbose)
    if resume_state is not None:
        run.restore(resume_state)
    run.announce()
    run.window_start = time.perf_counter()
    try:
        while run.step < run.total_steps:
            run.train_step()
            last = run.step == run.total_steps or run.status == "diverged"
            if run.step % run.cfg.trainer.log_every == 0 or last:
                run.log_progress()
            if last or is_eval_step(run.step, run.total_steps, run.eval_every, run.at_rungs):
                run.evaluate_and_report(report, last)
            if run.status == "diverged":
                break
    finally:
        # also when Tune stops the trial (an exception raised inside this loop): a reused
        # Ray worker must not keep this run's objects frozen, out of the collector's reach
        gc.unfreeze()
    return run.result()


class Run:
    """The state of one training run, and the steps that move it on."""

    def __init__(self, cfg: RunConfig, verbose: bool) -> None:
        self.cfg = cfg
        t = cfg.trainer
        self.rank, self.world, local_rank = distributed_info()
        if self.world != t.workers:
            # each step accumulates for trainer.workers ranks' share of the batch: on fewer
            # ranks it would train part of the batch and log all of it
            raise ConfigError(
                f"trainer.workers={t.workers}, but this process is one of {self.world} rank"
                f"{'s' * (self.world != 1)}: run it through `python -m sweeper` (Ray Train "
                "starts the ranks) or set trainer.workers to the process group's size"
            )
        self.device = device = resolve_device(t.device, local_rank)
        self.dtype = resolve_dtype(t.dtype, device)
        if t.threads:
            torch.set_num_threads(t.threads)
        if device.type == "cpu":
            release_freed_memory()  # of earlier runs in this (reused Ray) worker
            keep_freed_memory_for_reuse()
        reset_peak_memory(device)  # after the release: an earlier run's peak is not this one's
        self.verbose = verbose and self.rank == 0

        torch.manual_seed(t.seed)
        self.data = load_data(cfg.data, cfg.model.seq_len)
        self.use_compile = t.compile == "true" or (t.compile == "auto" and device.type == "cuda")
        residual = residual_dtype_for(device, self.dtype)
        ops = ops_for(device, self.use_compile)
        self.model = GPT(GPTShape.from_config(cfg.model), residual, ops).to(device)
        self.counts, self.flops_per_token = self.model.param_counts(), self.model.flops_per_token()
        self.total_steps = resolve_total_steps(cfg, self.counts["total"], self.flops_per_token)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.sampler = BatchSampler(
            self.data.train, t.device_batch_size, cfg.model.seq_len, t.seed, self.rank, self.world
        )
        self.accum = cfg.grad_accum_steps
        self.eval_every, self.at_rungs = evaluation_steps(
            cfg, self.total_steps, self.flops_per_token
        )
        self.tokens_per_step = t.total_batch_size
        max_loss = t.max_loss or 1.5 * math.log(cfg.model.vocab_size)
        self.divergence = DivergenceWatch(max_loss, t.max_loss_patience, cfg.model.vocab_size)

        self.train_model = (
            torch.compile(self.model, dynamic=False) if self.use_compile else self.model
        )
        if self.world > 1:
            self.train_model = torch.nn.parallel.DistributedDataParallel(
                self.train_model, device_ids=[local_rank] if device.type == "cuda" else None
            )
        self.peak = peak_flops(device, self.dtype)
        self.params = list(self.model.parameters())
        self.watch = ActivationWatch(self.model)  # read at each evaluation
        self.most_memory = 0.0  # bytes: the largest reading so far

        self.step, self.history, self.loss_trace = 0, [], []
        self.status, self.reason = "completed", None
        self.val_bpb, self.train_loss = None, float("nan")
        self.lrm = self.wdm = self.momentum = 0.0
        self.grad_norm = torch.zeros(())
        # the largest gradient norm since the last report: a spike between evaluations shows
        self.grad_norm_max: torch.Tensor | None = None
        self.ratios: dict[str, float] = {}
        self.train_seconds, self.window_tokens = 0.0, 0
        self.window_start = time.perf_counter()
        self.tok_s, self.mfu = 0.0, None
        self.start_step = self.timed_from = 0  # train_seconds times the steps after timed_from
        self.fork_steps_ahead = sorted(self.at_rungs) if t.rung_cooldown else []
        # training FLOPs of the cooldown forks so far: compute the sweep spent, though not the
        # run's own (its `flops`, the scaling fits' axis, leaves them out)
        self.fork_flops = 0.0

    def say(self, text: str) -> None:
        if self.verbose:
            print(text)

    def restore(self, state: dict) -> None:
        """Go on from a checkpoint's `state` (training_state). Tensors are taken out of the
        caller's dict as they are loaded: kept there, a resumed run held a second copy of
        its weights (and, on a GPU, of Muon's and AdamW's state) to its end."""
        self.model.load_state_dict(state.pop("model"))
        self.optimizer.load_state_dict(state.pop("optimizer"))
        for group in self.optimizer.param_groups:  # a checkpoint from before the decay's
            group.setdefault("initial_weight_decay", group["weight_decay"])  # schedule
        torch.set_rng_state(state["torch_rng"])
        self.step, self.history = state["step"], list(state["history"])
        self.loss_trace = list(state["loss_trace"])
        for past_step, past_loss in enumerate(self.loss_trace, 1):  # streaks go on
            self.divergence.check(past_loss, past_step)
        self.start_step = self.timed_from = self.step
        self.fork_steps_ahead = [s for s in self.fork_steps_ahead if s > self.step]
        if self.history:  # a checkpoint of the last step leaves nothing to train
            last = self.history[-1]
            self.val_bpb, self.train_loss = last["val_bpb"], last["train_loss"]
            self.fork_flops = last.get("fork_flops", 0.0)

    def announce(self) -> None:
        counts = self.counts
        self.say(
            f"model: {counts['total'] / 1e6:.2f}M params ({counts['matmul'] / 1e6:.2f}M matmul), "
            f"{self.flops_per_token / 1e6:.1f} MFLOP/token | {self.data.description}\n"
            f"run: {self.total_steps} steps x {self.tokens_per_step} tokens (accum {self.accum}, "
            f"workers {self.world}) on {self.device.type} {str(self.dtype).removeprefix('torch.')}"
            f"{' compiled' if self.use_compile else ''}"
        )
        for note in data_notes(self.data, self.cfg):
            self.say(f"note: {note}")
        if self.step:
            self.say(f"resumed at step {self.step}/{self.total_steps} from a checkpoint")

    def training_state(self) -> dict:
        # live tensors, not copies: the caller serialises them before training goes on
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "step": self.step,
            "history": list(self.history),
            "loss_trace": list(self.loss_trace),
        }

    def peak_memory_gib(self) -> float | None:
        """The run's peak memory so far (device.peak_memory_bytes); with DDP the largest
        rank's, which is what has to fit. The largest reading yet: the kernel's high-water
        mark is kept lazily and a later reading can come out lower."""
        held = peak_memory_bytes(self.device)
        if held is None:
            return None
        if self.world > 1:
            largest = torch.tensor(float(held), device=self.device)
            torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
            held = largest.item()
        self.most_memory = max(self.most_memory, held)
        return self.most_memory / 2**30

    def weight_decay_at(self, step: int) -> float:
        schedule = self.cfg.optimizer.weight_decay_schedule
        return weight_decay_multiplier(step, self.total_steps, schedule)

    def optimizer_step(
        self, batch_step: int, lrm: float, wdm: float, momentum: float, measure: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """One optimizer step on the batches of step `batch_step`: the summed micro-batch
        losses, the gradient's global norm before clipping (tensors: no device sync) and,
        if `measure`, how far the step moved each parameter group (`update_ratios`; the
        weights are copied after the backward pass, so the copy never adds to the
        activations' peak). Also a cooldown fork's step, with its own LR."""
        t, optimizer = self.cfg.trainer, self.optimizer
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            group["weight_decay"] = group["initial_weight_decay"] * wdm
            if "nesterov" in group:  # Muon's group
                group["momentum"] = momentum
        # forward/backward over micro-batches; DDP all-reduces only on the last one
        loss_sum = torch.zeros((), device=self.device)
        batches = self.sampler.step_batches(batch_step, self.accum, self.device)
        for micro, (x, y) in enumerate(batches):
            sync = self.world == 1 or micro == self.accum - 1
            with (
                contextlib.nullcontext() if sync else self.train_model.no_sync(),
                autocast_context(self.device, self.dtype),
            ):
                loss = self.train_model(x, y)
                if batch_step + 1 == t.nan_at_step:  # injected fault: NaN gradients and weights
                    loss = loss * float("nan")
            (loss / self.accum).backward()
            loss_sum += loss.detach()
        if t.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip)
        else:  # unclipped, the norm is still worth watching: spikes come before loss spikes
            grads = [p.grad for p in self.params if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads)
        before = weights_before_step(optimizer) if measure else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm, update_ratios(optimizer, before) if before else {}

    def train_step(self) -> None:
        """Schedule, forward/backward, step; then the divergence check."""
        cfg, step = self.cfg, self.step
        sched, opt = cfg.scheduler, cfg.optimizer
        schedule = (sched.name, sched.warmup_ratio, sched.warmdown_ratio, sched.final_lr_frac)
        self.lrm = lr_multiplier(step, self.total_steps, *schedule)
        self.momentum = muon_momentum(
            step, opt.muon_momentum_start, opt.muon_momentum, opt.muon_momentum_warmup
        )
        self.wdm = self.weight_decay_at(step)
        # before a report, how far the step moves the weights (a copy of them: only then,
        # it is not free)
        reports_next = step + 1 == self.total_steps or is_eval_step(
            step + 1, self.total_steps, self.eval_every, self.at_rungs
        )
        loss_sum, self.grad_norm, self.ratios = self.optimizer_step(
            step, self.lrm, self.wdm, self.momentum, reports_next
        )
        # maximum, not fmax: a NaN norm is the news, and must not be skipped over
        most = self.grad_norm_max
        self.grad_norm_max = self.grad_norm if most is None else torch.maximum(most, self.grad_norm)
        if self.world > 1:
            torch.distributed.all_reduce(loss_sum, op=torch.distributed.ReduceOp.AVG)
        self.train_loss = loss_sum.item() / self.accum
        self.loss_trace.append(self.train_loss)
        self.step += 1
        self.window_tokens += self.tokens_per_step
        # divergence fast-fail: NaN at once; over the limit or dead for the patience
        self.reason = self.divergence.check(self.train_loss, self.step)
        if self.reason:
            self.status = "diverged"
            self.say(f"step {self.step}: diverged: {self.reason}")
        if self.step == self.start_step + 1:
            self.after_first_step()

    def after_first_step(self) -> None:
        # long-lived objects are made by now; freezing them spares the GC ~0.5 s pauses
        gc.collect()
        gc.freeze()
        if self.step < self.total_steps and self.status != "diverged":
            # throughput excludes this first step (compilation and allocator warm-up) when
            # another step follows to be timed instead
            self.window_tokens, self.window_start = 0, time.perf_counter()
            self.timed_from = self.step

    def log_progress(self) -> None:
        elapsed = time.perf_counter() - self.window_start
        self.train_seconds += elapsed
        self.tok_s = self.window_tokens / max(elapsed, 1e-9)
        steps_left = self.total_steps - self.step
        eta = steps_left * self.train_seconds / max(self.step - self.timed_from, 1)
        self.mfu = utilization(self.flops_per_token, self.tok_s, self.peak, self.world)
        mfu = f"{100 * self.mfu:.1f}%" if self.mfu else "-"
        self.say(
            f"step {self.step:5d}/{self.total_steps} | loss {self.train_loss:.4f} | "
            f"grad norm {self.grad_norm.item():.3f} | lr x{self.lrm:.3f} | "
            f"{self.tok_s:,.0f} tok/s | mfu {mfu} | eta {eta:.0f}s"
        )
        self.window_tokens, self.window_start = 0, time.perf_counter()

    def evaluate_and_report(self, report: Report | None, last: bool) -> None:
        """Evaluate (and, at a sweep's rung, a cooled-down fork), then report."""
        eval_start = time.perf_counter()
        rung_val_bpb = self.evaluate_now()
        at_rung = bool(self.fork_steps_ahead) and self.step >= self.fork_steps_ahead[0]
        while self.fork_steps_ahead and self.step >= self.fork_steps_ahead[0]:
            self.fork_steps_ahead.pop(0)
        if at_rung and not last:
            cooled, fork_steps = self.cooled_val_bpb()
            self.fork_flops += fork_steps * self.tokens_per_step * self.flops_per_token
            if math.isfinite(cooled):  # a fork that blew up says nothing of the run
                rung_val_bpb = cooled
            self.say(
                f"step {self.step:5d}/{self.total_steps} | val bpb {cooled:.4f} after a "
                f"{fork_steps}-step cooldown fork (a rung)"
            )
        metrics = self.metrics(last, rung_val_bpb)
        self.history.append(metrics)
        self.grad_norm_max = None
        if report is not None:
            if self.cfg.trainer.checkpoint_every_eval and self.status != "diverged":
                report(metrics, state=self.training_state)
            else:
                report(metrics)
        # evaluation (and checkpointing) is not training time: the window's clock skips it,
        # and keeps the training steps before it in this log window
        self.window_start += time.perf_counter() - eval_start

    def evaluate_now(self) -> float:
        """The run's val_bpb now (NaN once diverged), with the evaluation's line."""
        if self.status == "diverged":
            self.val_bpb = float("nan")
            return self.val_bpb
        self.val_bpb = self.score(self.watch)
        moved = ", ".join(f"{name} {ratio:.1e}" for name, ratio in self.ratios.items())
        stats = self.watch.stats
        self.say(
            f"step {self.step:5d}/{self.total_steps} | val bpb {self.val_bpb:.4f}"
            + (f" | update/weight {moved}" if moved else "")
            + (f" | {activations_text(stats)}" if stats else "")
        )
        return self.val_bpb

    def score(self, watch: ActivationWatch | None = None) -> float:
        """val_bpb of the model as it is now (evaluation.evaluate)."""
        evaluated = self.train_model if self.world == 1 else self.model
        args = (self.data, self.cfg, self.device, self.dtype, self.rank, self.world, watch)
        return evaluate(evaluated, *args)

    def cooled_val_bpb(self) -> tuple[float, int]:
        """val_bpb of a copy of the run cooled down from here, and the fork's steps.

        Under WSD a run at its peak LR scores worse than after its decay, the more so the
        higher the LR, so a rung ranking runs as they are stops high-LR runs that would have
        won (measured: BENCHMARKS.md). The fork decays LR and weight decay linearly to the
        schedule's end over `rung_cooldown` x the steps so far, on the batches the run is
        about to see, is evaluated, and is thrown away: model, optimizer and RNG go back
        exactly as they were.
        """
        step, lrm, wdm = self.step, self.lrm, self.wdm
        steps = max(1, round(self.cfg.trainer.rung_cooldown * step))
        kept = {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "rng": torch.get_rng_state(),
        }
        try:
            final = self.cfg.scheduler.final_lr_frac
            final_wd = self.weight_decay_at(self.total_steps)  # linear: 0
            for i in range(steps):
                # each step at the middle of its own span of the decay: the last is not at the
                # final LR (0 under WSD: a step that moves nothing, paid for all the same),
                # and a one-step fork still cools
                done = (i + 0.5) / steps
                lr_now, wd_now = lrm + (final - lrm) * done, wdm + (final_wd - wdm) * done
                self.optimizer_step(step + i, lr_now, wd_now, self.momentum)
            value = self.score()
        finally:
            self.model.load_state_dict(kept["model"])
            self.optimizer.load_state_dict(kept["optimizer"])
            torch.set_rng_state(kept["rng"])
        return value, steps

    def metrics(self, last: bool, rung_val_bpb: float) -> dict[str, Any]:
        """One report's metrics."""
        tokens = self.step * self.tokens_per_step
        diverged = self.status == "diverged"
        metrics = {
            "step": self.step,
            "tokens": tokens,
            "flops": tokens * self.flops_per_token,
            # N of the scaling fits: a sweep's reports are all they read
            "params": self.counts["total"],
            "train_loss": self.train_loss,
            "val_bpb": self.val_bpb,
            "lr": self.lrm * cfg_peak_lr(self.cfg),
            # before clipping, at this step and the largest since the last report
            "grad_norm": self.grad_norm.item(),
            "grad_norm_max": self.grad_norm_max.item(),
            # ||step's update|| / ||weights|| per parameter group (update_ratios)
            **{f"update_ratio_{name}": ratio for name, ratio in self.ratios.items()},
            # MLP units off and dead, the residual stream's size, the soft-cap's saturation
            # (activations.py); none for a diverged run, not evaluated
            **(self.watch.stats if not diverged else {}),
            "tokens_per_s": self.tok_s,
            "mfu": self.mfu,
            "peak_memory_gib": self.peak_memory_gib(),
            "status": self.status if last else "running",
        }
        if self.cfg.trainer.rung_cooldown:  # what the sweep's rungs rank: see cooled_val_bpb
            metrics["rung_val_bpb"] = rung_val_bpb
            metrics["fork_flops"] = self.fork_flops
        if self.reason:
            metrics["reason"] = self.reason
        return metrics

    def result(self) -> dict[str, Any]:
        tokens = self.step * self.tokens_per_step
        timed_steps = self.step - self.timed_from
        # a run resumed at its last step trains nothing here: it has no speed to report
        tok_s = (
            timed_steps * self.tokens_per_step / self.train_seconds
            if timed_steps and self.train_seconds
            else None
        )
        mfu = utilization(self.flops_per_token, tok_s, self.peak, self.world) if tok_s else None
        return {
            "status": self.status,
            **({"reason": self.reason} if self.reason else {}),
            "val_bpb": self.val_bpb,
            "train_loss": self.train_loss,
            "tokens": tokens,
            "flops": tokens * self.flops_per_token,
            "params": self.counts["total"],
            "params_matmul": self.counts["matmul"],
            "params_non_embedding": self.counts["non_embedding"],
            "flops_per_token": self.flops_per_token,
            "tokens_per_s": tok_s,
            "mfu": mfu,
            "peak_memory_gib": self.peak_memory_gib(),
            "steps": self.step,
            "workers": self.world,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": self.device.type,
            "train_seconds": self.train_seconds,
            "unigram_bpb": unigram_bpb(self.data),
            "history": self.history,
            "loss_trace": self.loss_trace,
        }


def cfg_peak_lr(cfg: RunConfig) -> float:
    """The headline peak LR reported as `lr`: Muon's matrix LR, or AdamW's single LR."""
    return cfg.optimizer.lr if cfg.optimizer.name == "adamw" else cfg.optimizer.matrix_lr
