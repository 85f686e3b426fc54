"""TinyGPT: finite-difference gradient check, logprob/entropy semantics, chunked passes, Adam, save/load."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from palaestra.models import _runtime
from palaestra.models.optim import Adam
from palaestra.models.tinygpt import FORMAT_VERSION, ChunkedCache, GPTConfig, TinyGPT, param_shapes
from palaestra.models.tokenizer import SPECIAL_TOKENS, Tokenizer

SMALL_VOCAB = [*SPECIAL_TOKENS, *"0123456789+-", "Final: "]


def tiny_model(dtype: str = "float64", seed: int = 1, jitter: float = 0.2) -> TinyGPT:
    tok = Tokenizer(SMALL_VOCAB)
    cfg = GPTConfig(
        vocab_size=tok.vocab_size, block_size=8, d_model=16, n_layer=2, n_head=2, d_ff=24, dtype=dtype
    )
    m = TinyGPT(cfg, tokenizer=tok, seed=seed)
    rng = np.random.default_rng(seed)
    for p in m.params.values():  # move away from the init (unit gains, zero biases) so every path matters
        p += rng.normal(0.0, jitter, p.shape).astype(p.dtype)
    return m


def test_gradient_check_float64() -> None:
    m = tiny_model()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, m.config.vocab_size, size=(3, 8))
    w = rng.normal(size=(3, 7))
    res = m.forward_logprobs(ids)
    grads = m.backward_logprobs(res.cache, w)
    assert set(grads) == set(m.params)

    def objective() -> float:
        return float((m.logprobs_of(ids) * w).sum())

    eps = 1e-6
    for name, p in m.params.items():
        flat, num = p.reshape(-1), np.zeros(p.size)
        for i in range(p.size):
            old = flat[i]
            flat[i] = old + eps
            up = objective()
            flat[i] = old - eps
            down = objective()
            flat[i] = old
            num[i] = (up - down) / (2 * eps)
        ana = grads[name].reshape(-1)
        assert ana.shape == num.shape and ana.dtype == np.float64
        d = m.config.d_model
        if name.endswith("attn.b_qkv"):
            # the key bias shifts every score of a query equally: its gradient is exactly 0 analytically
            assert np.abs(ana[d : 2 * d]).max() < 1e-12 and np.abs(num[d : 2 * d]).max() < 1e-7, name
            ana, num = np.r_[ana[:d], ana[2 * d :]], np.r_[num[:d], num[2 * d :]]
        rel = np.abs(ana - num).max() / max(np.abs(num).max(), 1e-12)
        assert rel < 1e-5, f"{name}: max relative error {rel:.2e}"
        big = np.abs(num) > 1e-2  # elementwise relative error where the gradient is not tiny
        if big.any():
            assert (np.abs(ana - num)[big] / np.abs(num[big])).max() < 1e-4, name


def test_logprobs_and_entropy_match_full_softmax() -> None:
    m = tiny_model()
    ids = np.array([[1, 7, 8, 9, 3, 4], [2, 2, 9, 9, 10, 6]])
    res = m.forward_logprobs(ids, need_cache=False)
    logits = m.forward_logits(ids[:, :-1])
    logz = logits - logits.max(-1, keepdims=True)
    logz -= np.log(np.exp(logz).sum(-1, keepdims=True))
    want = np.take_along_axis(logz, ids[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(res.logp, want, atol=1e-12)
    np.testing.assert_allclose(res.entropy, -(np.exp(logz) * logz).sum(-1), atol=1e-12)
    assert res.cache is None and res.logp.shape == (2, 5)
    # the last position may be block_size (it is only a target)
    assert m.logprobs_of(np.zeros((1, m.config.block_size + 1), dtype=int)).shape == (1, 8)


def test_right_padding_is_harmless() -> None:
    m = tiny_model()
    short = [1, 7, 8, 9]
    padded = np.array([short + [m.tokenizer.pad_id] * 3, [1, 2, 3, 4, 5, 6, 7]])
    np.testing.assert_allclose(m.logprobs_of(padded)[0, :3], m.logprobs_of(np.array([short]))[0], atol=1e-12)


def test_bad_ids_are_rejected() -> None:
    m = tiny_model()
    with pytest.raises(ValueError, match="token ids must be in"):
        m.forward_logprobs(np.array([[0, m.config.vocab_size]]))
    with pytest.raises(ValueError, match="exceeds the model limit"):
        m.forward_logprobs(np.zeros((1, m.config.block_size + 2), dtype=int))
    with pytest.raises(ValueError, match="at least 2 tokens"):
        m.forward_logprobs(np.zeros((2, 1), dtype=int))
    with pytest.raises(ValueError, match="integers"):
        m.forward_logprobs(np.zeros((2, 3)))
    res = m.forward_logprobs(np.zeros((2, 3), dtype=int))
    with pytest.raises(ValueError, match="dlogp has shape"):
        m.backward_logprobs(res.cache, np.zeros((2, 3)))
    with pytest.raises(ValueError, match="need_cache=True"):
        m.backward_logprobs(None, np.zeros((2, 2)))


def test_chunked_pass_matches_single_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    m = tiny_model()
    rng = np.random.default_rng(5)
    ids = rng.integers(0, m.config.vocab_size, size=(7, 6))
    w = rng.normal(size=(7, 5))
    _runtime.set_num_workers(1)
    try:
        one = m.forward_logprobs(ids)
        g1 = m.backward_logprobs(one.cache, w)
        monkeypatch.setattr(_runtime, "MIN_ROWS_PER_CHUNK", 1)
        _runtime.set_num_workers(3)
        assert len(_runtime.chunk_slices(7, 5)) == 3
        many = m.forward_logprobs(ids)
        assert isinstance(many.cache, ChunkedCache) and len(many.cache.chunks) == 3
        g3 = m.backward_logprobs(many.cache, w)
    finally:
        _runtime.set_num_workers(None)
    np.testing.assert_allclose(many.logp, one.logp, atol=1e-12)
    np.testing.assert_allclose(many.entropy, one.entropy, atol=1e-12)
    for name in g1:
        np.testing.assert_allclose(g3[name], g1[name], atol=1e-10, err_msg=name)


def test_float32_default_and_param_count() -> None:
    tok = Tokenizer.default()
    m = TinyGPT(GPTConfig(vocab_size=tok.vocab_size))
    assert all(p.dtype == np.float32 for p in m.params.values())
    assert m.n_params == sum(int(np.prod(s)) for s in param_shapes(m.config).values())
    res = m.forward_logprobs(np.array([[1, 2, 3]]))
    assert res.logp.dtype == np.float32
    twin = m.copy()
    twin.params["wte"] += 1.0
    assert not np.array_equal(twin.params["wte"], m.params["wte"]) and twin.config == m.config
    with pytest.raises(ValueError, match="vocab_size"):
        TinyGPT(GPTConfig(vocab_size=5))
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(vocab_size=10, d_model=10, n_head=4)
    for field, value in [("n_layer", 0), ("d_ff", 2.5), ("n_head", True), ("block_size", -1)]:
        with pytest.raises(ValueError, match=rf"GPTConfig\.{field} must be a positive int, got {value!r}"):
            GPTConfig(vocab_size=10, **{field: value})
    with pytest.raises(ValueError, match=r"GPTConfig\.dtype must be 'float32' or 'float64', got 'float16'"):
        GPTConfig(vocab_size=10, dtype="float16")


def test_passes_reject_ids_that_are_not_a_batch() -> None:
    m = tiny_model()
    for ids in (np.array([1, 2, 3]), np.zeros((0, 3), dtype=int), np.ones((1, 2, 3), dtype=int)):
        with pytest.raises(
            ValueError, match=r"non-empty 2-D int array \(B, T\), got shape " + re.escape(str(ids.shape))
        ):
            m.forward_logprobs(ids)
        with pytest.raises(ValueError, match="non-empty 2-D int array"):
            m.forward_logits(ids)
    with pytest.raises(ValueError, match="ids must be integers"):
        m.forward_logits(np.ones((1, 2)))


def test_adam_rejects_bad_settings_gradients_and_state() -> None:
    m = tiny_model()
    for kwargs in ({"lr": -1.0}, {"betas": (1.0, 0.9)}, {"betas": (0.9, -0.1)}, {"eps": 0.0}):
        with pytest.raises(ValueError, match="invalid Adam hyper-parameters"):
            Adam(m.params, **{"lr": 1e-3, **kwargs})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"invalid Adam hyper-parameters .* wd=-0\.1"):
        Adam(m.params, lr=1e-3, weight_decay=-0.1)
    opt = Adam(m.params, lr=1e-3)
    grads = {k: np.zeros_like(v) for k, v in m.params.items()}
    with pytest.raises(ValueError, match=r"gradients missing for \['head\.b'\]"):
        opt.step({k: v for k, v in grads.items() if k != "head.b"})
    with pytest.raises(ValueError, match=r"gradient sizes \(\d+\) do not match the params"):
        opt.step({**grads, "head.b": np.zeros(m.params["head.b"].size + 1)})
    assert opt.t == 0  # neither refused step counted
    state = opt.state_dict()
    with pytest.raises(ValueError, match="Adam state has no 'step'"):
        opt.load_state_dict({k: v for k, v in state.items() if k != "step"})
    with pytest.raises(ValueError, match="Adam state lacks 'v/wte'"):
        opt.load_state_dict({k: v for k, v in state.items() if k != "v/wte"})
    wrong = {**state, "m/head.b": np.zeros(3)}
    with pytest.raises(ValueError, match=r"Adam state 'm/head\.b' has shape \(3,\), param is"):
        opt.load_state_dict(wrong)


def test_set_num_workers_takes_a_positive_int_or_none() -> None:
    for bad in (0, -2, 1.5, "4"):
        with pytest.raises(ValueError, match=rf"num workers must be a positive int or None, got {bad!r}"):
            _runtime.set_num_workers(bad)  # type: ignore[arg-type]
    assert _runtime.num_workers() >= 1  # the refused calls left the setting alone


def test_adam_clips_and_state_round_trip() -> None:
    m1, m2 = tiny_model(seed=3), tiny_model(seed=3)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, m1.config.vocab_size, size=(4, 6))
    o1 = Adam(m1.params, lr=1e-2, clip_norm=0.5, weight_decay=0.1)
    o2 = Adam(m2.params, lr=1e-2, clip_norm=0.5, weight_decay=0.1)

    def grads(m: TinyGPT) -> dict[str, np.ndarray]:
        r = m.forward_logprobs(ids)
        return m.backward_logprobs(r.cache, -np.ones((4, 5)))

    norms = [o1.step(grads(m1)) for _ in range(3)]
    g = grads(m1)
    assert norms[0] == pytest.approx(np.sqrt(sum(float((x * x).sum()) for x in grads(m2).values())))
    for _ in range(3):
        o2.step(grads(m2))
    state = o2.state_dict()
    assert state["step"] == 3 and all(isinstance(v, (int, np.ndarray)) for v in state.values())
    o3 = Adam(m2.params, lr=1e-2, clip_norm=0.5, weight_decay=0.1)
    o3.load_state_dict(state)
    o1.step(g)
    o3.step(grads(m2))
    for name in m1.params:
        np.testing.assert_allclose(m1.params[name], m2.params[name], atol=1e-12)
    before = {k: v.copy() for k, v in m1.params.items()}
    bad = {k: np.full_like(v, np.nan) for k, v in g.items()}
    assert not np.isfinite(o1.step(bad))
    assert all(np.array_equal(before[k], m1.params[k]) for k in before)  # skipped


def test_training_reduces_loss_and_adam_moves_params() -> None:
    m = tiny_model(dtype="float32", jitter=0.0)
    ids = np.array([[1, 7, 8, 9, 10, 11, 12]] * 8)
    opt = Adam(m.params, lr=1e-2)
    losses = []
    for _ in range(30):
        r = m.forward_logprobs(ids)
        losses.append(-float(r.logp.mean()))
        opt.step(m.backward_logprobs(r.cache, -np.ones_like(r.logp) / r.logp.size))
    assert losses[-1] < 0.2 * losses[0]


def test_save_load_round_trip(tmp_path: Path) -> None:
    m = tiny_model(dtype="float32")
    opt = Adam(m.params, lr=1e-3)
    r = m.forward_logprobs(np.array([[1, 2, 3, 4]]))
    opt.step(m.backward_logprobs(r.cache, np.ones((1, 3))))
    path = tmp_path / "sub" / "ckpt.npz"
    m.save(path, optimizer=opt, meta={"name": "x", "step": 7})
    loaded = TinyGPT.load(path)
    assert loaded.config == m.config and loaded.tokenizer == m.tokenizer
    assert loaded.meta == {"name": "x", "step": 7}
    for name, p in m.params.items():
        assert np.array_equal(loaded.params[name], p) and loaded.params[name].dtype == np.float32
    assert loaded.optimizer_state is not None
    opt2 = Adam(loaded.params, lr=1e-3)
    opt2.load_state_dict(loaded.optimizer_state)
    assert opt2.t == 1
    ids = np.array([[1, 5, 9, 3]])
    np.testing.assert_array_equal(loaded.logprobs_of(ids), m.logprobs_of(ids))
    assert not list(path.parent.glob("*.tmp"))
    with np.load(path, allow_pickle=False) as npz:  # readable without pickle
        assert int(npz["format_version"]) == FORMAT_VERSION
        assert json.loads(str(npz["vocab_json"])) == SMALL_VOCAB


def test_load_rejects_bad_files(tmp_path: Path) -> None:
    m = tiny_model(dtype="float32")
    path = tmp_path / "m.npz"
    m.save(path)
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["format_version"] = np.array(FORMAT_VERSION + 1)
    future = tmp_path / "future.npz"
    np.savez(future, **arrays)
    with pytest.raises(ValueError, match=r"format version 2 is not supported"):
        TinyGPT.load(future)
    arrays["format_version"] = np.array(FORMAT_VERSION)
    del arrays["param/head.b"]
    broken = tmp_path / "broken.npz"
    np.savez(broken, **arrays)
    with pytest.raises(ValueError, match=r"broken\.npz: params do not match config: missing \['head\.b'\]"):
        TinyGPT.load(broken)
    arrays["param/head.b"] = np.zeros(3)
    np.savez(broken, **arrays)
    with pytest.raises(ValueError, match=r"broken\.npz: params: 'head\.b' has shape \(3,\), config expects"):
        TinyGPT.load(broken)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=r"junk\.npz"):
        TinyGPT.load(junk)
    untagged = tmp_path / "untagged.npz"
    np.savez(untagged, **{k: v for k, v in arrays.items() if k != "format_version"})
    with pytest.raises(ValueError, match=r"untagged\.npz: not a TinyGPT checkpoint \(no format_version\)"):
        TinyGPT.load(untagged)
    no_vocab = tmp_path / "no_vocab.npz"
    np.savez(no_vocab, **{k: v for k, v in arrays.items() if k != "vocab_json"})
    with pytest.raises(ValueError, match=r"no_vocab\.npz: not a readable TinyGPT checkpoint \('vocab_json'"):
        TinyGPT.load(no_vocab)
    bad_config = tmp_path / "bad_config.npz"
    np.savez(bad_config, **{**arrays, "config_json": np.array(json.dumps({"vocab_size": 0}))})
    with pytest.raises(ValueError, match=r"bad_config\.npz: not a readable .*vocab_size must be a positive"):
        TinyGPT.load(bad_config)
    bad_vocab = tmp_path / "bad_vocab.npz"
    np.savez(bad_vocab, **{**arrays, "vocab_json": np.array(json.dumps([*SMALL_VOCAB, ""]))})
    with pytest.raises(
        ValueError, match=r"bad_vocab\.npz: .*vocab entries must be non-empty strings, got ''"
    ):
        TinyGPT.load(bad_vocab)


def test_named_weights_are_the_params_themselves() -> None:
    m = tiny_model()
    W = m.weights
    named = {
        "wte": W.wte,
        "wpe": W.wpe,
        "lnf.g": W.lnf_g,
        "lnf.b": W.lnf_b,
        "head.w": W.head_w,
        "head.b": W.head_b,
    }
    for i, blk in enumerate(W.blocks):
        named.update(blk.named(i))
    assert len(W.blocks) == m.config.n_layer and named.keys() == m.params.keys()
    assert all(named[k] is p for k, p in m.params.items())  # views, not copies
    assert W.blocks[1].w_qkv is m.params["h1.attn.w_qkv"] and W.head_b is m.params["head.b"]
    m.params["h0.mlp.b2"] += 1.0  # an in-place update (what Adam does) shows through the names
    assert np.array_equal(m.weights.blocks[0].b2, m.params["h0.mlp.b2"])
    assert {k: v.shape for k, v in named.items()} == param_shapes(m.config)


def test_config_reads_older_checkpoints_and_rejects_unknown_fields() -> None:
    tok = Tokenizer.default()
    cfg = GPTConfig(vocab_size=tok.vocab_size)
    assert (
        GPTConfig.from_dict({**cfg.to_dict(), "activation": "relu"}) == cfg
    )  # written before it was dropped
    with pytest.raises(ValueError, match="relu"):
        GPTConfig.from_dict({**cfg.to_dict(), "activation": "gelu"})
    with pytest.raises(ValueError, match="unknown fields"):
        GPTConfig.from_dict({**cfg.to_dict(), "dropout": 0.1})


@pytest.mark.parametrize("name", ["arith-base", "calc-base"])
def test_shipped_checkpoints_load_unchanged(name: str) -> None:
    from palaestra.models.registry import WEIGHTS_DIR

    path = WEIGHTS_DIR / f"{name}.npz"
    m = TinyGPT.load(path)
    with np.load(path, allow_pickle=False) as npz:
        stored = {f[6:]: npz[f] for f in npz.files if f.startswith("param/")}
    assert stored.keys() == m.params.keys()
    assert all(np.array_equal(stored[k], m.params[k]) for k in stored)


def test_trunk_functions_serve_a_model_without_the_head() -> None:
    """trunk_forward/trunk_backward work on any parameter dict with a trunk (a reward model drops the head)."""
    from palaestra.models.tinygpt import Trunk, trunk_backward, trunk_forward

    m = tiny_model()
    params = {k: v for k, v in m.params.items() if not k.startswith("head.")}
    W = Trunk.of(params, m.config.n_layer)
    rng = np.random.default_rng(4)
    x = rng.integers(0, m.config.vocab_size, size=(2, 5))
    R = rng.normal(size=(10, m.config.d_model))

    def objective() -> float:
        return float((trunk_forward(W, m.config.n_head, x)[0] * R).sum())

    acts: list = []
    _, xhatf, rstdf = trunk_forward(W, m.config.n_head, x, acts=acts)
    grads = trunk_backward(W, m.config.n_head, x, acts, R, xhatf, rstdf)
    assert grads.keys() == params.keys()
    eps = 1e-6
    for name in ("wte", "h0.attn.w_qkv", "h1.mlp.w1", "lnf.g"):
        flat = params[name].reshape(-1)
        for i in rng.choice(flat.size, 5, replace=False):
            old = flat[i]
            flat[i] = old + eps
            up = objective()
            flat[i] = old - eps
            down = objective()
            flat[i] = old
            assert grads[name].reshape(-1)[i] == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-8), (
                name
            )
