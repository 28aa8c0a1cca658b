"""Linear layers in fp32 on oneDNN's matmul: the same values and gradients as F.linear, and
F.linear itself wherever oneDNN is not the faster kernel or not in play."""

import pytest
import torch
import torch.nn.functional as F

import sweeper.train.linear as linear_module
from sweeper.train.linear import Linear, linear
from sweeper.train.model import GPT, GPTShape


@pytest.fixture
def onednn(monkeypatch):
    """Take oneDNN's fp32 matmul whatever this CPU's timed probe said (the kernel is real)."""
    monkeypatch.setattr(linear_module, "cpu_fp32_matmul_by_onednn", lambda: True)


def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    return ((result.double() - reference).norm() / reference.norm()).item()


# (out, in) of each kind of the model's matrices: wider out (the MLP's input and the QKV
# projection), narrower out (the MLP's output) and square
@pytest.mark.parametrize("out_features, in_features", [(96, 24), (24, 96), (32, 32), (72, 24)])
@pytest.mark.parametrize("leading", [(40,), (3, 20)])  # tokens, and (batch, tokens)
def test_values_and_gradients_match_an_fp64_reference(onednn, out_features, in_features, leading):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*leading, in_features, generator=g, dtype=torch.float64)
    w = torch.randn(out_features, in_features, generator=g, dtype=torch.float64)
    grad = torch.randn(*leading, out_features, generator=g, dtype=torch.float64)
    x64, w64 = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.linear(x64, w64).backward(grad)
    x32, w32 = x.float().requires_grad_(), w.float().requires_grad_()
    out = linear(x32, w32)
    assert type(out.grad_fn).__name__ == "_OneDNNLinearBackward"  # the path under test
    out.backward(grad.float())
    assert relative_error(out, F.linear(x, w)) < 1e-6
    assert relative_error(x32.grad, x64.grad) < 1e-6
    assert relative_error(w32.grad, w64.grad) < 1e-6
    assert w32.grad.is_contiguous()  # as a parameter's gradient is kept


def test_only_the_weight_gradient_when_the_input_needs_none(onednn):
    x, w = torch.randn(8, 16), torch.randn(4, 16, requires_grad=True)
    linear(x, w).sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(8, 4).T @ x)


def test_torchs_linear_wherever_onednn_is_not_taken(onednn, monkeypatch):
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    assert linear_module.use_onednn(x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's bf16 matmul
        assert not linear_module.use_onednn(x, w)
        assert linear(x, w).dtype == torch.bfloat16
    assert not linear_module.use_onednn(x.double(), w.double())
    assert not linear_module.use_onednn(x.bfloat16(), w.bfloat16())
    monkeypatch.setattr(linear_module, "cpu_fp32_matmul_by_onednn", lambda: False)
    out = linear(x, w)
    assert type(out.grad_fn).__name__ == "MmBackward0"
    torch.testing.assert_close(out, F.linear(x, w), rtol=0, atol=0)


def test_the_module_keeps_nn_linears_parameters_and_hooks(onednn):
    layer = Linear(16, 4)
    assert list(layer.state_dict()) == ["weight"]  # no bias, as the model's checkpoints hold
    seen = []
    layer.register_forward_hook(lambda module, inputs, output: seen.append(output.shape))
    layer(torch.randn(2, 3, 16))
    assert seen == [torch.Size([2, 3, 4])]


def test_a_gpt_trains_to_the_same_loss_and_gradients_on_either_kernel(onednn, monkeypatch):
    shape = GPTShape(depth=2, d_model=64, head_dim=32, seq_len=32, vocab_size=256)
    torch.manual_seed(0)
    model = GPT(shape)
    with torch.no_grad():  # nonzero output projections, so every matrix gets a gradient
        for block in model.blocks:
            block.attn.c_proj.weight.normal_(std=0.02)
            block.mlp.c_proj.weight.normal_(std=0.02)
    idx = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))

    def loss_and_grads():
        model.zero_grad()
        loss = model(idx, idx)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads()
    monkeypatch.setattr(linear_module, "cpu_fp32_matmul_by_onednn", lambda: False)
    reference_loss, reference_grads = loss_and_grads()
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    for grad, reference in zip(grads, reference_grads, strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-4, atol=1e-6)
