"""The CUDA path: bf16 autocast, torch.compile, pinned-memory batches and MFU. Marked `gpu`;
skipped (and shown as skipped) where torch sees no CUDA device, as in CI."""

import math

import numpy as np
import pytest
import torch

from sweeper.train.activations import ACTIVATION_COLUMNS
from sweeper.train.data import BatchSampler
from sweeper.train.device import peak_flops
from sweeper.train.loop import train
from sweeper.train.model import GPT, GPTShape, residual_dtype_for

from .conftest import tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = {"device": "cuda", "dtype": "bfloat16", "compile": "true", "threads": None}


def test_compiled_bf16_training_on_cuda_learns_and_reports_mfu():
    result = train(tiny(trainer=CUDA | {"max_steps": 40, "eval_every": 40}), verbose=False)
    assert (result["status"], result["device"], result["dtype"]) == (
        "completed",
        "cuda",
        "bfloat16",
    )
    assert result["loss_trace"][0] == pytest.approx(math.log(256), abs=0.1)
    assert result["val_bpb"] < result["unigram_bpb"] - 1.0, result
    if peak_flops(torch.device("cuda"), torch.bfloat16) is None:  # a GPU of unknown peak
        assert result["mfu"] is None
    else:
        assert 0.0 < result["mfu"] < 1.0, result["mfu"]
    # the activations' figures of a compiled run: its graph skips the hooks, so they come
    # from an eager pass over the evaluation's first batch
    assert set(ACTIVATION_COLUMNS) <= result["history"][-1].keys()
    # torch's CUDA allocator's peak: the tiny model's weights, state and activations, MiBs
    assert 0.0 < result["peak_memory_gib"] < 1.0, result["peak_memory_gib"]


def test_compiled_model_matches_eager_on_cuda():
    """The model as the loop trains it on a GPU: residual stream in bf16."""
    torch.manual_seed(0)
    residual = residual_dtype_for(torch.device("cuda"), torch.bfloat16)
    model = GPT(GPTShape(2, 128, 64, 64, 256), residual).cuda()
    with torch.no_grad():  # non-trivial output projections and scalars
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    idx = torch.randint(0, 256, (4, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = model(idx, idx)
        compiled = torch.compile(model, dynamic=False)(idx, idx)
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)


def test_cuda_batches_equal_cpu_batches():
    tokens = np.arange(10_000, dtype=np.uint16)
    on_cpu = list(BatchSampler(tokens, 2, 16, seed=3).step_batches(5, 3, "cpu"))
    on_gpu = list(BatchSampler(tokens, 2, 16, seed=3).step_batches(5, 3, torch.device("cuda")))
    for (xc, yc), (xg, yg) in zip(on_cpu, on_gpu, strict=True):
        assert xg.is_cuda and torch.equal(xg.cpu(), xc) and torch.equal(yg.cpu(), yc)
