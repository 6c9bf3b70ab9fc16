"""Chunked logprobs equal the full-logits computation, values and gradients, and skip what they should."""

from __future__ import annotations

import functools
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


def packed_and_padded(lengths: list[int], vocab: int) -> tuple[Any, Any, list[Any]]:
    """Random samples of these lengths (the first 3 tokens context), packed and padded."""
    from turnrl.train.batch import TrainSample, collate, pack

    gen = torch.Generator().manual_seed(1)
    samples = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        mask = [0, 0, 0] + [1] * (n - 3)
        samples.append(TrainSample(ids, mask, [0.0] * n, [float(m) for m in mask]))
    return pack(samples), collate(samples, 0), samples


@pytest.mark.parametrize("name", ["tiny-qwen3", "smollm2"])
def test_packed_rows_give_each_sample_its_own_logprobs_and_gradients(
    name: str, tiny_qwen3_dir: Path, smollm2: Any
) -> None:
    """Samples end to end in one row (positions restarting at 0, no attention mask) give the same
    logprobs and gradients as padded rows: nothing leaks across a seam (Qwen3 and Llama)."""
    model = load_model(str(tiny_qwen3_dir)) if name == "tiny-qwen3" else smollm2
    packed, padded, samples = packed_and_padded([9, 17, 5, 12], model.config.vocab_size)
    assert packed.input_ids_B_T.shape == (1, 43) and padded.input_ids_B_T.shape == (4, 17)
    assert packed.position_ids_B_T is not None and packed.position_ids_B_T[0, 9:12].tolist() == [0, 1, 2]
    out = {}
    for kind, b in (("packed", packed), ("padded", padded)):
        logp = token_logprobs(
            model,
            b.input_ids_B_T,
            b.attention_mask_B_T,
            b.loss_mask_B_T > 0,
            position_ids_B_T=b.position_ids_B_T,
        )
        (-(logp * b.loss_mask_B_T).sum()).backward()
        out[kind] = (logp[b.loss_mask_B_T > 0], grads(model))
    assert torch.allclose(out["packed"][0], out["padded"][0], atol=1e-4)
    for key, grad in out["padded"][1].items():
        # float32 sums in another order (packed rows, padded rows): differences scale with the
        # gradient's own size (SmolLM2's reach 100, where 1e-3 apart is 1e-5 of the scale)
        scale = max(float(grad.abs().max()), 1.0)
        assert torch.allclose(out["packed"][1][key], grad, atol=1e-5 * scale, rtol=1e-3), key
    lone = token_logprobs(model, torch.tensor([samples[1].input_ids]))  # the second sample alone
    assert torch.allclose(out["packed"][0][6:20], lone[0, 3:].detach(), atol=1e-4)


def test_a_packed_sample_must_start_with_context() -> None:
    from turnrl.train.batch import TrainSample, batches_of, micro_batches, pack

    with pytest.raises(ValueError, match="must start with a context token"):
        pack([TrainSample([1, 2], [1, 1], [0.0, 0.0], [1.0, 1.0])])
    samples = [TrainSample([1] * n, [0] + [1] * (n - 1), [0.0] * n, [1.0] * n) for n in (9, 7, 5, 3)]
    assert [[len(s.input_ids) for s in g] for g in micro_batches(samples, 12, packed=True)] == [
        [9],
        [7, 5],
        [3],
    ]
    assert [b.input_ids_B_T.shape[1] for b in batches_of(samples, 12, 0, packed=True)] == [9, 12, 3]
    assert [tuple(b.input_ids_B_T.shape) for b in batches_of(samples, 12, 0, packed=False)] == [
        (1, 9),
        (1, 7),
        (2, 5),
    ]


def test_auto_packs_only_where_attention_takes_variable_lengths(model: Any) -> None:
    from types import SimpleNamespace

    from turnrl.train.batch import packs

    assert model.config._attn_implementation in ("sdpa", "eager") and not packs("auto", model)
    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    assert packs("auto", flash) and packs(True, model) and not packs(False, flash)


def test_kept_probabilities_skip_the_recomputation_and_give_the_same_values_and_gradients(
    tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``keep_mib`` worth 2.2 chunks of 7 positions keeps the first two chunks' probabilities: their
    backward projects nothing again, and values and gradients equal the recomputing path's, also
    on a second backward pass over the same graph."""
    import turnrl.train.logprobs as module

    model = load_model(str(tiny_qwen3_dir), dtype=torch.float64)
    ids, attention = inputs()
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    weights = weights * attention
    recomputed = token_logprobs(model, ids, attention, temperature=0.7, chunk_size=7)
    (recomputed * weights).sum().backward()
    expected = grads(model)

    projections = []
    real_logits = module._logits
    monkeypatch.setattr(module, "_logits", lambda *a: projections.append(1) or real_logits(*a))
    chunk_mib = 7 * model.get_output_embeddings().weight.shape[0] * 8 / 2**20
    kept = token_logprobs(model, ids, attention, temperature=0.7, chunk_size=7, keep_mib=2.2 * chunk_mib)
    chunks = len(projections)
    (kept * weights).sum().backward(retain_graph=True)
    assert chunks == -(-int(attention[:, 1:].numel()) // 7) and len(projections) == 2 * chunks - 2
    first = grads(model)
    (kept * weights).sum().backward()
    second = grads(model)
    torch.testing.assert_close(kept, recomputed, atol=1e-12, rtol=0)
    assert first.keys() == second.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(first[name], expected[name], atol=1e-12, rtol=1e-10, msg=name)
        torch.testing.assert_close(second[name], expected[name], atol=1e-12, rtol=1e-10, msg=name)


def group_samples(prompt: int, rests: list[int], vocab: int, seed: int = 2) -> list[Any]:
    """One random prompt of ``prompt`` tokens, then a random rest of each length (trained on)."""
    from turnrl.train.batch import TrainSample

    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(0, vocab, (prompt,), generator=gen).tolist()
    out = []
    for n in rests:
        ids = head + torch.randint(0, vocab, (n,), generator=gen).tolist()
        mask = [0] * prompt + [1] * n
        out.append(TrainSample(ids, mask, [0.0] * len(ids), [float(m) for m in mask]))
    return out


@pytest.mark.parametrize(
    ("name", "dtype", "value_tol", "grad_tol"),
    [
        ("tiny-qwen3", torch.float64, 1e-12, 1e-6),
        ("tiny-qwen3", torch.float32, 1e-4, 1e-4),
        ("smollm2", torch.float32, 1e-4, 1e-4),
    ],
)
def test_a_shared_prefix_runs_once_and_gives_the_whole_rows_logprobs_and_gradients(
    name: str,
    dtype: torch.dtype,
    value_tol: float,
    grad_tol: float,
    tiny_qwen3_dir: Path,
    smollm2: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows that begin with the same prompt (a GRPO group) run it through the body once: the body
    sees 1 x 11 prompt tokens, then 4 rows of their rest; logprobs and every gradient equal the
    padded rows' (Qwen3 and Llama). In float64 the values agree to rounding; gradients to float32's
    (Qwen3's RMSNorm computes in float32, and its backward now sums the rows' gradients first)."""
    from turnrl.train.batch import collate

    model = load_model(str(tiny_qwen3_dir), dtype=dtype) if name == "tiny-qwen3" else smollm2
    samples = group_samples(11, [6, 9, 4, 7], model.config.vocab_size)
    samples[2].loss_mask[5] = 1  # a loss token inside the shared prefix is fine too
    plain = collate(samples, 0)
    shapes: list[tuple[int, ...]] = []
    body = model.get_decoder()
    original = type(body).forward

    @functools.wraps(original)
    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        shapes.append(tuple(kwargs["input_ids"].shape))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(body), "forward", spy)
    out = {}
    for shared in (0, 11):
        logp = token_logprobs(
            model,
            plain.input_ids_B_T,
            plain.attention_mask_B_T,
            plain.loss_mask_B_T > 0,
            shared_prefix=shared,
        )
        (-(logp * plain.loss_mask_B_T).sum()).backward()
        out[shared] = (logp[plain.loss_mask_B_T > 0], grads(model))
    assert shapes == [(4, 20), (1, 11), (4, 9)]
    assert torch.allclose(out[11][0], out[0][0], atol=value_tol)
    for key, grad in out[0][1].items():
        assert torch.allclose(out[11][1][key], grad, atol=grad_tol, rtol=1e-3), key


def test_micro_batches_share_the_prefix_of_a_group_and_count_it_once() -> None:
    """Samples go in clusters by common prefix (two groups' prompts, a sample alone); each cluster's
    micro-batches fit the budget counting the prefix once and are marked with what their rows
    share; samples with images, and a lone sample, go in plain padded rows. When packing, a group
    shares only where that runs fewer tokens; the others are packed."""
    from dataclasses import replace

    from turnrl.train.batch import batches_of, common_prefix, prefix_clusters

    a = group_samples(40, [10, 20, 5], 1000, seed=3)
    b = group_samples(30, [8, 8], 1000, seed=4)
    lone = group_samples(50, [3], 1000, seed=5)
    image = replace(group_samples(40, [4], 1000, seed=3)[0], multimodal={"pixel_values": torch.zeros(1)})
    assert common_prefix(a[0].input_ids, a[1].input_ids) == 40 and common_prefix([1, 2], [1, 2, 3]) == 2
    clusters = prefix_clusters(a + b + lone, 24)
    assert sorted((len(c), shared) for c, shared in clusters) == [(1, 0), (2, 30), (3, 40)]
    # a: 40 + 3 x 20 = 100 fits; a budget of 90 splits it where that runs fewest tokens: the longest
    # alone (60), the others shared (40 + 2 x 10 = 60): 120, not 80 + 45 (the longest two shared)
    out = batches_of(a + b + lone + [image], 100, 0, packed=False, share_min=24)
    assert sorted((tuple(x.input_ids_B_T.shape), x.shared_prefix) for x in out) == [
        ((1, 44), 0), ((1, 53), 0), ((2, 38), 30), ((3, 60), 40),
    ]  # fmt: skip
    split = batches_of(a, 90, 0, packed=False, share_min=24)
    assert [(tuple(x.input_ids_B_T.shape), x.shared_prefix) for x in split] == [((2, 50), 40), ((1, 60), 0)]
    assert all(x.shared_prefix == 0 for x in batches_of(a + b, 100, 0, packed=False))  # share_min 0: off
    assert all(x.shared_prefix == 0 for x in batches_of(a + b, 100, 0, packed=False, share_min=41))
    # packing (flash attention): a group shares where that runs fewer tokens than its rows packed;
    # a: 40 + 3 x 20 = 100 against 155 packed. skewed: 24 + 2 x 60 = 144 against 26 + 84 = 110
    skewed = group_samples(24, [2, 60], 1000, seed=6)
    mixed = batches_of(a + skewed + lone, 200, 0, packed=True, share_min=24)
    layout = [(tuple(x.input_ids_B_T.shape), x.shared_prefix, x.position_ids_B_T is not None) for x in mixed]
    assert layout == [((3, 60), 40, False), ((1, 84 + 53 + 26), 0, True)]


def test_prefixes_are_shared_only_where_every_layer_caches_plain_keys_and_values(model: Any) -> None:
    """Qwen3 and Llama (full attention) share prefixes; a body with linear-attention layers (Qwen3-Next:
    three of every four layers keep a recurrent state, not keys and values) does not."""
    from types import SimpleNamespace

    from transformers import Qwen3NextConfig

    from turnrl.train.logprobs import shares_prefixes

    assert shares_prefixes(model)
    hybrid = SimpleNamespace(get_decoder=lambda: SimpleNamespace(config=Qwen3NextConfig(num_hidden_layers=4)))
    assert not shares_prefixes(hybrid)


def test_an_agent_runs_branches_share_their_trunk_not_only_the_groups_prompt() -> None:
    """Two runs of one prompt (20 tokens), each with two branches forked after a trunk of 50 more:
    each run's branches are a cluster sharing 70 tokens (runs 70 + 2 x 10 = 90 tokens each, 180),
    not one cluster of four sharing the prompt's 20 (20 + 4 x 60 = 260)."""
    from turnrl.train.batch import TrainSample, prefix_clusters

    def sample(ids: list[int]) -> TrainSample:
        return TrainSample(ids, [1] * len(ids), [0.0] * len(ids), [1.0] * len(ids))

    prompt = list(range(1, 21))
    runs = [[100 + 1000 * r + k for k in range(50)] for r in range(2)]
    branches = [
        sample(prompt + trunk + [5000 + 10 * b + k for k in range(10)]) for trunk in runs for b in range(2)
    ]
    clusters = prefix_clusters(branches, 16)
    assert [(len(c), shared) for c, shared in clusters] == [(2, 70), (2, 70)]
    plain = [sample(prompt + [7000 + 10 * i + k for k in range(30)]) for i in range(3)]  # a GRPO group
    assert [(len(c), shared) for c, shared in prefix_clusters(plain, 16)] == [(3, 20)]
