"""Tests of examples/generate.py: sampling with a K/V cache and pallas_flash.decode_attention.

The central check: greedy decoding with the cache (flash-attention prefill, then one
decode_attention call per layer and token inside a jitted scan) gives the same tokens, and the
same logits within a float32 tolerance, as re-running the full model forward over every sequence
after each new token. Untrained tiny-preset weights keep it short on the CPU, in interpret mode;
prompts of different lengths, one of them a single byte, cross page boundaries while decoding.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import ON_GPU, example_module

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "generate.py"
# Lengths 1, 16 and 21: with 16-key pages and 12 new tokens, the sequences end inside their
# first, second and third page, and two of them cross a page boundary while decoding.
_PROMPTS = ["R", "First Citizen:\nW", "KING RICHARD II:\nNo, "]


@pytest.fixture(scope="module")
def gen():
    with example_module(_EXAMPLE, "generate_example") as module:
        yield module


@pytest.fixture(scope="module")
def model(gen):
    cfg = gen.train_lm.build_config(gen.train_lm.parse_args(["--preset", "tiny"]))
    return cfg, gen.train_lm._init_params(cfg, jax.random.key(3))


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged"])
def test_greedy_with_cache_matches_full_forward(gen, model, page_size):
    cfg, params = model
    check = gen.check_against_full_forward(cfg, params, _PROMPTS, 12, page_size=page_size)
    assert check["passed"], check["rel_err"]
    assert check["rel_err"] <= check["rtol"] == (5e-3 if ON_GPU else 1e-4)
    if not ON_GPU:
        # Interpret mode is exact up to summation order: no near tie can flip a token.
        assert check["first_divergence"] is None, (check["cached"]["tokens"],
                                                   check["full"]["tokens"])
    assert check["cached"]["tokens"].shape == (3, 12)
    assert check["cached"]["logits"].shape == (3, 12, 256)
    layout = check["cached"]["layout"]
    if page_size:
        # The prompt width (21) rounds up to two pages; 21 + 12 positions need three.
        assert layout.paged and layout.page_size == 16 and layout.pages_per_seq == 3
    else:
        assert not layout.paged and layout.max_len == 21 + 12


def test_sampling_temperature_and_top_k(gen, model):
    cfg, params = model
    # One compiled loop for all four: the temperature is traced, top_k the same.
    greedy = gen.generate(cfg, params, _PROMPTS[:2], 6, temperature=0.0, top_k=8, seed=1)
    np.testing.assert_array_equal(greedy["tokens"], greedy["logits"].argmax(-1))
    a = gen.generate(cfg, params, _PROMPTS[:2], 6, temperature=1.0, top_k=8, seed=1)
    b = gen.generate(cfg, params, _PROMPTS[:2], 6, temperature=1.0, top_k=8, seed=1)
    c = gen.generate(cfg, params, _PROMPTS[:2], 6, temperature=1.0, top_k=8, seed=2)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert not np.array_equal(a["tokens"], c["tokens"])
    assert not np.array_equal(a["tokens"], greedy["tokens"])
    # Every sampled token is among the 8 most likely under the logits it was drawn from.
    top8 = np.argsort(a["logits"], axis=-1)[..., -8:]
    assert (top8 == a["tokens"][..., None]).any(-1).all()


def test_compare_greedy_stops_at_the_first_differing_token(gen):
    logits = np.zeros((2, 3, 4), np.float32)
    logits[:, :, 1] = 1.0
    tokens = np.ones((2, 3), np.int32)
    full = {"tokens": tokens, "logits": logits}
    check = gen.compare_greedy(full, full, 1e-4)
    assert check["passed"] and check["rel_err"] == 0 and check["first_divergence"] is None
    # Sequence 1 flips a near tie at step 1 (token 1 over 2 by 1e-4 in the full path, 2 over 1
    # by 1e-4 with the cache); its later logits (another sequence) do not count.
    full["logits"][1, 1, 2] = 1.0 - 1e-4
    flipped = {"tokens": tokens.copy(), "logits": logits.copy()}
    flipped["tokens"][1, 1:] = 2
    flipped["logits"][1, 1, 2] = 1.0 + 1e-4
    flipped["logits"][1, 2] = 5.0
    check = gen.compare_greedy(flipped, full, 1e-3)
    assert check["passed"] and check["first_divergence"] == 1
    assert check["max_abs_diff"] == pytest.approx(2e-4, rel=1e-3)
    # A flip with logits far apart fails.
    flipped["logits"][1, 1, 2] = 2.0
    assert not gen.compare_greedy(flipped, full, 1e-3)["passed"]


def test_block_table_shuffles_every_page_once(gen):
    layout = gen.make_layout(3, 40, 16)
    assert (layout.max_len, layout.pages_per_seq) == (48, 3)
    assert layout.cache_shape(gen.train_lm.PRESETS["tiny"]) == (9, 16, 2, 32)
    table = gen.make_block_table(layout, seed=0)
    assert table.shape == (3, 3) and table.dtype == np.int32
    assert sorted(table.ravel()) == list(range(9))
    assert not np.array_equal(table.ravel(), np.arange(9))
    assert gen.make_block_table(gen.make_layout(3, 40, None), seed=0) is None


def test_checkpoint_round_trip(gen, model, tmp_path):
    cfg, params = model
    path = gen.train_lm.save_checkpoint(tmp_path / "lm.npz", cfg, params)
    assert path == tmp_path / "lm.npz" and path.exists()
    cfg2, params2 = gen.train_lm.load_checkpoint(path)
    assert cfg2 == cfg
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_main_from_a_checkpoint_paged_with_check(gen, model, tmp_path, capsys):
    # The command line: load, sample a batch with the paged cache, then the greedy check. The
    # paged check above has compiled the same shapes.
    cfg, params = model
    path = gen.train_lm.save_checkpoint(tmp_path / "lm.npz", cfg, params)
    argv = ["--checkpoint", str(path), "--tokens", "12", "--paged", "--check"]
    result = gen.main(argv + [a for p in _PROMPTS for a in ("--prompt", p)])
    out = capsys.readouterr().out
    assert result["ok"] and result["check"]["passed"], out
    assert len(result["texts"]) == 3 and result["tokens"].shape == (3, 12)
    assert "batch 3 | cache paged, 3 pages of 16 per sequence" in out
    assert "tokens/s" in out and "-> PASSED" in out


@pytest.mark.parametrize("call, message", [
    (lambda g: g.make_layout(2, 10, 0), "page_size must be positive"),
    (lambda g: g.encode_prompts(["a", ""], 4), "prompts must not be empty"),
    (lambda g: g.generate(None, None, ["a"], 0), "steps must be positive"),
])
def test_errors(gen, call, message):
    with pytest.raises(ValueError, match=message):
        call(gen)
