"""Chunked logprobs equal the full-logits computation, values and gradients, and skip what they should."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from turnrl.models import load_model
from turnrl.train.logprobs import naive_token_logprobs, token_logprobs


@pytest.fixture
def model(tiny_qwen3_dir: Path) -> Any:
    """A private copy of the tiny Qwen3 (its .grad fields get written)."""
    return load_model(str(tiny_qwen3_dir))


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of random ids; the second is right-padded by 6."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 150000, (2, 23), generator=gen)
    attention = torch.ones_like(ids)
    attention[1, -6:] = 0
    ids[1, -6:] = 151643
    return ids, attention


def grads(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, cloned; then the gradients are cleared."""
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize(
    ("dtype", "temperature", "value_tol", "grad_tol"),
    [(torch.float32, 1.0, 1e-5, 1e-4), (torch.float64, 0.7, 1e-10, 1e-10)],
)
def test_chunked_equals_naive_values_and_gradients(
    tiny_qwen3_dir: Path, temperature: float, dtype: torch.dtype, value_tol: float, grad_tol: float
) -> None:
    """float32 agrees to rounding (values 1e-5, gradients 1e-4 of their largest entry); float64 exactly."""
    model = load_model(str(tiny_qwen3_dir), dtype=dtype)
    ids, attention = inputs()
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1), dtype=dtype) * attention
    naive = naive_token_logprobs(model, ids, attention, temperature=temperature)
    (naive * weights).sum().backward()
    expected = grads(model)
    chunked = token_logprobs(model, ids, attention, temperature=temperature, chunk_size=7)
    (chunked * weights).sum().backward()
    got = grads(model)
    real = attention.bool()
    real[:, 0] = False
    assert chunked.dtype == naive.dtype == dtype
    torch.testing.assert_close(chunked[real], naive[real], atol=value_tol, rtol=value_tol / 10)
    assert (chunked[:, 0] == 0).all()
    assert got.keys() == expected.keys()
    for name in expected:
        scale = float(expected[name].abs().max())
        torch.testing.assert_close(got[name], expected[name], atol=grad_tol * scale, rtol=0, msg=name)


def test_only_asked_positions_are_computed_and_padding_gets_zero_gradient(model: Any) -> None:
    ids, attention = inputs()
    positions = torch.zeros_like(ids, dtype=torch.bool)
    positions[0, 10:15] = True
    positions[1, 12:17] = True  # the padding starts at 17
    embeddings: list[torch.Tensor] = []

    def keep(module: Any, args: Any, output: torch.Tensor) -> None:
        output.retain_grad()
        embeddings.append(output)

    handle = model.get_input_embeddings().register_forward_hook(keep)
    out = token_logprobs(model, ids, attention, positions, chunk_size=3)
    handle.remove()
    with torch.no_grad():
        full = token_logprobs(model, ids, attention)
    assert (out[~positions] == 0).all()
    torch.testing.assert_close(out[positions], full[positions], atol=1e-5, rtol=0)
    out.sum().backward()
    grad = embeddings[0].grad
    assert grad is not None
    assert (grad[1, 16:] == 0).all()  # padding, and the last asked position's own input, feed nothing
    assert (grad[0, 14:] == 0).all()
    assert grad[0, :14].abs().sum() > 0


def test_no_grad_path_skips_checkpointing(model: Any) -> None:
    ids, attention = inputs()
    with torch.no_grad():
        out = token_logprobs(model, ids, attention, chunk_size=4)
    assert not out.requires_grad
    with torch.no_grad():
        naive = naive_token_logprobs(model, ids, attention)
    torch.testing.assert_close(out[attention.bool()], naive[attention.bool()], atol=1e-5, rtol=0)


def test_frozen_head_gets_no_gradient_and_the_rest_still_matches(model: Any) -> None:
    model.get_output_embeddings().weight.requires_grad_(False)  # tied: the embeddings too
    ids, attention = inputs()
    (naive_token_logprobs(model, ids, attention) * attention).sum().backward()
    expected = grads(model)
    (token_logprobs(model, ids, attention, chunk_size=5) * attention).sum().backward()
    got = grads(model)
    assert "model.embed_tokens.weight" not in got and got.keys() == expected.keys()
    for name in expected:
        scale = float(expected[name].abs().max())
        torch.testing.assert_close(got[name], expected[name], atol=1e-4 * scale, rtol=0, msg=name)


def test_bfloat16_autocast_is_close_to_float32_and_keeps_float32_weights_and_gradients(model: Any) -> None:
    """``autocast=torch.bfloat16`` (``train.precision: bfloat16``): the body's and the head's
    products in bfloat16, the parameters, their gradients and the returned logprobs float32; the
    values within bfloat16's rounding of the float32 ones, the gradients pointing the same way."""
    ids, attention = inputs()
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)) * attention
    full = token_logprobs(model, ids, attention)
    (full * weights).sum().backward()
    expected = grads(model)
    mixed = token_logprobs(model, ids, attention, autocast=torch.bfloat16)
    (mixed * weights).sum().backward()
    got = grads(model)
    real = attention.bool()
    real[:, 0] = False
    assert mixed.dtype == torch.float32 and all(g.dtype == torch.float32 for g in got.values())
    gap = float((mixed - full).detach()[real].abs().max())
    assert 0 < gap < 0.25  # bfloat16 did run; measured: 0.11 nats at most, on logprobs near -14.6
    flat = lambda g: torch.cat([v.flatten() for v in g.values()])  # noqa: E731
    assert float(F.cosine_similarity(flat(got), flat(expected), dim=0)) > 0.99
