"""What the activations look like at an evaluation: dead MLP units, the residual stream, the
soft-capped logits.

Read from the first TOKENS of the first validation batch at each report:
`mlp_zero_fraction`, the share of the MLPs' ReLU^2 outputs that are zero (about half at
init; far more means units dying); `dead_units`, the share of MLP units zero for every token
read; `residual_rms`, the RMS of the residual stream the last block hands to the final norm
(one growing without bound is a run going unstable before its loss shows it); and
`softcap_saturation`, the share of logits the tanh soft-cap holds past SATURATED of its cap,
where their gradient has all but vanished (None without a cap).

Forward hooks, as torch has no such monitor: the evaluation runs the forward pass anyway, so
reading it costs a comparison and a reduction per layer, not a pass.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch itself is imported where used: a sweep's driver reads the columns
    import torch

ACTIVATION_COLUMNS = ("mlp_zero_fraction", "dead_units", "residual_rms", "softcap_saturation")
# the figures read this many tokens of the batch: an MLP unit off for all of them is dead,
# and the share of zeros is known to ~0.1%. All of a 4096-token batch cost 24 ms an
# evaluation of the `small` model on 2 CPU cores (15% of it), mostly the comparisons.
TOKENS = 1024
# a tanh past this is saturated (its gradient under 6% of its slope at 0): the threshold of
# Karpathy's activation statistics (makemore, part 3)
SATURATED = 0.97


class ActivationWatch:
    """Forward hooks on a GPT's MLP input projections, its last block and its output head,
    attached only while `recording()`: every other forward pass runs without them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model  # the eager module: hooks on it do not reach a compiled graph
        self.stats: dict[str, float] = {}

    @contextlib.contextmanager
    def recording(self):
        """Record the next forward pass; `stats` then holds its figures (or stays empty if
        no hook ran, as when the pass went through a compiled graph)."""
        import torch

        zero, dead, rms, saturated = [], [], [], []
        cap = self.model.shape.softcap
        # |cap * tanh(z / cap)| > SATURATED * cap  <=>  |z| > cap * atanh(SATURATED)
        raw_limit = cap * math.atanh(SATURATED)

        def on_mlp_input(module, inputs, pre_activation):
            pre = pre_activation.detach().flatten(0, -2)[:TOKENS]  # (tokens, units)
            off = pre <= 0  # ReLU^2 outputs zero exactly here
            zero.append(torch.count_nonzero(off) / off.numel())
            dead.append((pre.amax(dim=0) <= 0).float().mean())  # off for every token

        def on_last_block(module, inputs, output):
            residual = output.detach().flatten(0, -2)[:TOKENS]
            norm = torch.linalg.vector_norm(residual, dtype=torch.float32)
            rms.append(norm / residual.numel() ** 0.5)

        def on_logits(module, inputs, logits):  # before the soft-cap
            raw = logits.detach().flatten(0, -2)[:TOKENS]
            saturated.append(torch.count_nonzero(raw.abs() > raw_limit) / raw.numel())

        blocks = self.model.blocks
        hooks = [block.mlp.c_fc.register_forward_hook(on_mlp_input) for block in blocks]
        hooks.append(blocks[-1].register_forward_hook(on_last_block))
        if cap:  # no cap, no tanh to saturate
            hooks.append(self.model.lm_head.register_forward_hook(on_logits))
        self.stats = {}
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
        if zero and rms:
            # every layer's MLP is as wide as the others: the mean of the layers' shares is
            # the share over all of them
            figures = [torch.stack(zero).mean(), torch.stack(dead).mean(), rms[-1], *saturated]
            values = torch.stack(figures).tolist()  # one device sync for them all
            self.stats = {
                "mlp_zero_fraction": values[0],
                "dead_units": values[1],
                "residual_rms": values[2],
                "softcap_saturation": values[3] if saturated else None,
            }

    def record(self, x: torch.Tensor) -> None:
        """One eager forward pass to record, of as many of `x`'s sequences as hold TOKENS
        tokens (the figures read no more): for a model whose evaluation ran compiled."""
        import torch

        rows = -(-TOKENS // x.size(1))
        with torch.no_grad(), self.recording():
            self.model(x[:rows])


def activations_text(stats: dict[str, float | None]) -> str:
    """The progress line's part: 'mlp zeros 52%, dead 0.0% | resid rms 1.23 | softcap
    saturated 0.0%'."""
    text = (
        f"mlp zeros {100 * stats['mlp_zero_fraction']:.0f}%, "
        f"dead {100 * stats['dead_units']:.1f}% | resid rms {stats['residual_rms']:.3g}"
    )
    if stats["softcap_saturation"] is not None:
        text += f" | softcap saturated {100 * stats['softcap_saturation']:.1f}%"
    return text
