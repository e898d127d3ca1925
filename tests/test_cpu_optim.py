"""The native CPU Lion and Adagrad (csrc/optim/cpu_optim.c) against their torch definitions: zero's
Lion and torch.optim.Adagrad, several steps, every gradient dtype, the 16-bit copy-out."""
import pytest
import torch

from zero.ops.cpu_optim import adagrad_step, lion_step
from zero.optim.lion import Lion


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lion_and_adagrad_equal_their_torch_optimizers(grad_dtype):
    torch.manual_seed(0)
    n = 3 * (1 << 14) + 5  # several tiles and a ragged end
    grads = [(torch.randn(n) * 4).to(grad_dtype) for _ in range(3)]
    start = torch.randn(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    lion, adagrad = (torch.nn.Parameter(start.clone()) for _ in range(2))
    torch_lion = Lion([lion], lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    torch_adagrad = torch.optim.Adagrad([adagrad], lr=1e-2, lr_decay=0.1, weight_decay=0.01, eps=1e-10,
                                        initial_accumulator_value=0.1, foreach=False)
    p_lion, m = start.clone(), torch.zeros(n)
    p_ada, s = start.clone(), torch.full((n,), 0.1)
    for step, g in enumerate(grads, 1):
        lion.grad = adagrad.grad = g.float() / 4.0
        torch_lion.step()
        torch_adagrad.step()
        lion_step(p_lion, g, m, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, grad_scale=4.0, out16=out)
        adagrad_step(p_ada, g, s, clr=1e-2 / (1 + (step - 1) * 0.1), eps=1e-10, weight_decay=0.01, grad_scale=4.0)
    assert (p_lion - lion.detach()).abs().max() < 1e-6 and torch.equal(out, p_lion.bfloat16())
    assert (m - torch_lion.state[lion]["exp_avg"]).abs().max() < 1e-6
    assert (p_ada - adagrad.detach()).abs().max() < 1e-6
    assert ((s - torch_adagrad.state[adagrad]["sum"]).abs() / s).max() < 1e-6


def test_bad_arguments_are_named_before_anything_changes():
    p, g, m = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    for call, says in ((lambda: lion_step(p, g, torch.zeros(3), lr=1e-3, betas=(0.9, 0.99)), "exp_avg"),
                       (lambda: lion_step(p, g, m, lr=-1.0, betas=(0.9, 0.99)), "lr must be a finite number >= 0"),
                       (lambda: lion_step(p, g, m, lr=1e-3, betas=(0.9, 1.0)), "betas must be two numbers"),
                       (lambda: adagrad_step(p, g.double(), m, clr=1e-2, eps=1e-10), "grad"),
                       (lambda: adagrad_step(p, g, m, clr=1e-2, eps=1e-10, grad_scale=0.0), "grad_scale")):
        with pytest.raises(ValueError, match=says):
            call()
    assert not p.any() and not m.any()
