"""HF backend (issue 9): a tiny random Llama built in code (no download), LoRA training with the shared loss
code, generation with logprobs through the shared OpenAI-compatible app, checkpoints, the vLLM push path.

Everything here runs on CPU offline. The vLLM test talks to a local fake that only mimics the HTTP shape of
vLLM's runtime-LoRA and chat endpoints (it is NOT vLLM)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

from openai.types.chat.chat_completion import Choice  # noqa: E402

from palaestra.models.hf import HFModel  # noqa: E402
from palaestra.trainer.backend import TrainBatch  # noqa: E402
from palaestra.trainer.checkpoints import load_checkpoint, save_checkpoint  # noqa: E402
from palaestra.trainer.config import TrainConfig  # noqa: E402
from palaestra.trainer.hf_backend import HFBackend, row_logprobs  # noqa: E402
from palaestra.trainer.tokenize import MissingLogprobsError, TokenizedTrajectory, tokenize_rows  # noqa: E402
from palaestra.trajectories.types import Trajectory, TrajectoryGroup, choice_to_message  # noqa: E402

pytestmark = pytest.mark.hf

LOGPROB_TOL = 1e-4  # |sampling-time logprob - backend recomputation|, float32 CPU (observed ~5e-7)
PROMPTS = [
    [{"role": "user", "content": "What is 2+3? Reply with one line: Final: <int>"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 41-7?"}],
]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Any:
    """The tiny model gains nothing from intra-op threads, and OpenMP spin-waits make 2 threads very slow on a
    busy 2-core machine; restored after this module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def hf_trainer_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """GRPOTrainer must pick HFBackend for an HFModel (``model.backend_kind == "hf"``). Until that hook is in
    palaestra/trainer/loop.py, it is patched in here, for this test only."""
    from palaestra.trainer import loop

    try:
        loop.GRPOTrainer(tiny(), TrainConfig())
        return
    except TypeError:
        pass
    original = loop.GRPOTrainer.__init__

    def init(self: Any, model: Any, config: Any = None, backend: Any = None) -> None:
        if backend is None and getattr(model, "backend_kind", None) == "hf":
            backend = HFBackend(model, config if config is not None else TrainConfig())
        original(self, model, config, backend)

    monkeypatch.setattr(loop.GRPOTrainer, "__init__", init)


def tiny(**kw: Any) -> HFModel:
    return HFModel.tiny("tiny-random-llama", seed=0, **kw)


async def sample_trajectories(model: HFModel, n: int = 4, seed: int = 1, **kw: Any) -> list[Trajectory]:
    client = model.openai_client()
    out = []
    for p, msgs in enumerate(PROMPTS):
        resp = await client.chat.completions.create(
            model=model.name,
            messages=msgs,
            n=n,
            max_tokens=kw.pop("max_tokens", 10),
            logprobs=True,
            seed=seed + p,
            **kw,
        )
        for i, c in enumerate(resp.choices):
            out.append(Trajectory(messages_and_choices=[*msgs, c], reward=float(i % 2)))
    return out


def batch_of(trajs: list[Trajectory]) -> TrainBatch:
    r = np.array([t.reward for t in trajs])
    return TrainBatch(trajs, r - r.mean())


def test_import_is_lazy_without_torch() -> None:
    code = (
        "import sys, palaestra.models.hf as h; print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
    import palaestra.models.hf as hf

    with pytest.raises(AttributeError, match=r"module 'palaestra\.models\.hf' has no attribute 'HFModle'"):
        hf.HFModle  # noqa: B018
    # without the extra (torch cannot be imported), the lazy names say what to install
    code = "import sys; sys.modules['torch'] = None; import palaestra.models.hf as h; h.HFModel"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 1
    assert (
        "ImportError: palaestra.models.hf.HFModel needs the hf extra: pip install 'palaestra[hf]'"
        in run.stderr
    )


def test_chat_tokenizer_template_and_vocab() -> None:
    from palaestra.models.hf import TINY_MODEL_NAMES
    from palaestra.models.hf.tiny import TINY_MODELS

    assert set(TINY_MODEL_NAMES) == set(TINY_MODELS)  # the light list the config layer can read
    model = tiny()
    tok = model.tokenizer
    r = tok.render(PROMPTS[1], add_generation_prompt=True)
    assert r.text == "<|system|>Be brief.<|end|><|user|>What is 41-7?<|end|><|assistant|>"
    assert tok.decode(r.ids, skip_special=False) == r.text
    assert all(tok.id_of(tok.vocab[i]) == i for i in range(tok.vocab_size))
    assert all(tok.token_str(tok.id_of(t)) == t for t in ("<|assistant|>", "F", tok.vocab[7]))
    assert tok.id_of("token_id:7") == 7
    with pytest.raises(KeyError):
        tok.id_of("not-a-token")
    with pytest.raises(ValueError, match="unknown role"):
        tok.render([{"role": "robot", "content": "x"}])


async def test_generation_seeds_stop_length_and_shared_app() -> None:
    model = tiny()
    client = model.openai_client()
    kw: dict[str, Any] = {
        "model": model.name,
        "messages": PROMPTS[0],
        "n": 3,
        "max_tokens": 8,
        "logprobs": True,
    }
    a = await client.chat.completions.create(seed=7, **kw)
    b = await client.chat.completions.create(seed=7, **kw)
    c = await client.chat.completions.create(seed=8, **kw)
    texts = [ch.message.content for ch in a.choices]
    assert texts == [ch.message.content for ch in b.choices]
    assert texts != [ch.message.content for ch in c.choices]
    assert a.system_fingerprint == "tiny-random-llama@step0"
    assert all(ch.finish_reason == "length" and len(ch.logprobs.content) == 8 for ch in a.choices)
    stop = texts[0][2]
    s = await client.chat.completions.create(seed=7, stop=[stop], **kw)
    assert (
        s.choices[0].finish_reason == "stop"
        and s.choices[0].message.content == texts[0][: texts[0].index(stop)]
    )
    g1 = await model.generate(PROMPTS[0], n=2, temperature=0.0, max_tokens=6)
    g2 = await model.generate(PROMPTS[0], n=2, temperature=0.0, max_tokens=6)
    assert [x.token_ids for x in g1] == [x.token_ids for x in g2] and g1[0].token_ids == g1[1].token_ids
    import openai

    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=model.name, messages=PROMPTS[0], temperature=5.0)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope", messages=PROMPTS[0])


async def test_training_lowers_loss_on_a_fixed_batch_and_touches_only_lora() -> None:
    model = tiny()
    base_before = {n: p.detach().clone() for n, p in model.model.named_parameters() if not p.requires_grad}
    lora_before = model.adapter_state()
    batch = batch_of(await sample_trajectories(model))
    cfg = TrainConfig(lr=1e-2)
    backend = HFBackend(model, cfg)
    losses = [backend.train_step(batch, cfg)["loss"] for _ in range(6)]
    assert losses[-1] < losses[0] - 0.01, losses
    assert model.step == 6
    for n, p in model.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base_before[n]), n
    after = model.adapter_state()
    assert any(not np.array_equal(after[k], lora_before[k]) for k in after)


async def test_generation_logprobs_equal_backend_recomputation() -> None:
    model = tiny()
    cfg = TrainConfig(lr=1e-2)
    backend = HFBackend(model, cfg)
    backend.train_step(batch_of(await sample_trajectories(model, seed=3)), cfg)  # non-zero adapters
    trajs = await sample_trajectories(model, n=3, seed=11, temperature=0.7, top_p=0.9, max_tokens=12)
    packed = backend.tokenize(batch_of(trajs), cfg)
    assert packed.ids.shape[0] == len(trajs) and list(packed.owner) == list(range(len(trajs)))
    logp, _ = row_logprobs(backend.net, packed.ids, grad=False)
    diff = np.abs(logp.double().numpy() - packed.old_logp)[packed.mask]
    assert packed.mask.sum() == sum(len(t.messages_and_choices[-1].logprobs.content) for t in trajs)
    assert diff.max() < LOGPROB_TOL, diff.max()
    out = backend.train_step(batch_of(trajs), cfg)
    assert abs(out["ratio_mean"] - 1.0) < 1e-4 and out["clip_frac"] == 0.0


class _RecordingBackend(HFBackend):
    """Keeps the accumulated LoRA gradients of the last optimiser step (before clipping)."""

    def optimizer_step(self, cfg: TrainConfig) -> float:
        self.grads = {n: p.grad.detach().clone() for n, p in self.params.items()}
        return super().optimizer_step(cfg)


async def test_gradient_accumulation_matches_one_pass_and_clipping_applies() -> None:
    trajs = await sample_trajectories(tiny())
    cfg = TrainConfig(lr=1e-2)
    grads = []
    for mbs in (None, 3):
        backend = _RecordingBackend(tiny(micro_batch_size=mbs), cfg)
        out = backend.train_step(batch_of(trajs), cfg)
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in backend.grads.values())))
        assert out["grad_norm"] == pytest.approx(norm, rel=1e-5)
        grads.append(backend.grads)
    a, b = grads
    scale = max(float(g.abs().max()) for g in a.values())
    assert scale > 0 and all(torch.allclose(a[k], b[k], atol=1e-5 * scale) for k in a)
    start = tiny().adapter_state()
    moved = []
    for clip in (1e-12, None):
        m = tiny()
        c = TrainConfig(lr=1e-2, clip_norm=clip)
        HFBackend(m, c).train_step(batch_of(trajs), c)
        moved.append(max(np.abs(m.adapter_state()[k] - start[k]).max() for k in start))
    assert moved[0] < 1e-3 * moved[1]  # clipped to ~0, Adam's eps dominates: almost no move


def _choice(tok_ids: list[int], lps: list[float], model: HFModel, content: str, **extra: Any) -> Choice:
    entries = [
        {"token": model.tokenizer.vocab[t], "logprob": lp, "bytes": None, "top_logprobs": []}
        for t, lp in zip(tok_ids, lps)
    ]
    msg = {"role": "assistant", "content": content, **extra}
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": msg,
            "logprobs": {"content": entries, "refusal": None},
        }
    )


def choices_in(row: TokenizedTrajectory) -> int:
    """How many Choices (turns) a training row holds."""
    assert row.turn is not None
    return len(set(row.turn[row.mask].tolist()))


def test_choice_without_logprobs_is_re_rendered_by_the_template() -> None:
    model = tiny()
    tok = model.tokenizer
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 34}'}}
    bare = _choice([], [], model, "", tool_calls=[call]).model_copy(update={"logprobs": None})
    traj = Trajectory(messages_and_choices=[*PROMPTS[1], bare, {"role": "tool", "content": "34"}])
    with pytest.raises(MissingLogprobsError, match=r"messages_and_choices\[2\]"):
        tokenize_rows(traj, tok)
    (row,) = tokenize_rows(traj, tok, allow_missing_logprobs=True)
    prompt = model.render(PROMPTS[1])
    reply = tok.render([*PROMPTS[1], choice_to_message(bare)], add_generation_prompt=False).ids[len(prompt) :]
    n = reply.index(tok.end_id) + 1  # the call as the template writes it, through its end token
    assert tok.decode(reply[:n]).startswith("<tool_call>") and n > 5
    assert row.ids.tolist()[: len(prompt) + n] == prompt + reply[:n]
    assert (
        row.ids[row.mask].tolist() == reply[:n] and np.isnan(row.old_logp).all()
    )  # finish "stop": end trained
    cut = bare.model_copy(update={"finish_reason": "length"})
    (row2,) = tokenize_rows(
        Trajectory(messages_and_choices=[*PROMPTS[1], cut]), tok, allow_missing_logprobs=True
    )
    assert row2.ids[row2.mask].tolist() == reply[: n - 1]  # cut short: its end token is context


async def test_multi_turn_and_tool_call_masks() -> None:
    model = tiny()
    tok = model.tokenizer
    client = model.openai_client()
    traj = Trajectory(messages_and_choices=list(PROMPTS[1]))
    # turn 1: a tool call, as a tool-calling server would return it (text tokens + parsed call)
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 34}'}}
    as_msg = choice_to_message(_choice([], [], model, "", tool_calls=[call]))  # as later turns render it
    before = tok.render(traj.messages(), add_generation_prompt=True).text
    text = tok.render([*traj.messages(), as_msg], add_generation_prompt=False).text[len(before) :]
    assert text.startswith("<tool_call>") and text.endswith("</tool_call><|end|>")
    ids = tok.encode(text)  # the call as the model would have written it (ends with <|end|>)
    lps = list(model.logprobs_of([model.render(traj.messages()) + ids])[0][-len(ids) :])
    traj.messages_and_choices.append(_choice(ids, lps, model, "", tool_calls=[call]))
    traj.messages_and_choices.append({"role": "tool", "tool_call_id": "c1", "content": "34"})
    sampled = [ids]
    for turn in range(2):  # two more turns sampled through the shared app
        resp = await client.chat.completions.create(
            model=model.name, messages=traj.messages(), n=8, max_tokens=6, logprobs=True, seed=turn
        )
        # a reply holding a special token (the random model samples them) re-renders differently; such a
        # reply would (correctly) start a new row, which the second half of this test covers
        ch = next(
            c for c in resp.choices if not {tok.id_of(e.token) for e in c.logprobs.content} & tok.special_ids
        )
        traj.messages_and_choices.append(ch)
        sampled.append([tok.id_of(e.token) for e in ch.logprobs.content])
        traj.messages_and_choices.append({"role": "user", "content": f"again {turn}"})
    rows = tokenize_rows(traj, tok)
    assert len(rows) == 1 and choices_in(rows[0]) == 3
    row = rows[0]
    assert row.ids[row.mask].tolist() == [t for s in sampled for t in s]
    assert np.all(np.isfinite(row.old_logp[row.mask])) and np.all(np.isnan(row.old_logp[~row.mask]))
    last_prompt = model.render(traj.messages()[:-2])
    assert row.ids.tolist()[: len(last_prompt)] == last_prompt  # context = exactly what the server rendered
    # an earlier reply whose text no longer re-renders to its tokens (a stop string cut it): two rows
    items = list(traj.messages_and_choices)
    cut = items[4].model_copy(deep=True)
    cut.message.content = "zz"
    traj2 = Trajectory(messages_and_choices=[*items[:4], cut, *items[5:]])
    for ch in traj2.choices():  # as from a server that does not record prompt_token_ids: re-rendered
        ch.model_extra.pop("prompt_token_ids", None)  # type: ignore[union-attr]
    rows2 = tokenize_rows(traj2, tok)
    assert [choices_in(r) for r in rows2] == [2, 1]
    assert rows2[0].ids[rows2[0].mask].tolist() == sampled[0] + sampled[1]
    prompt3 = model.render(traj2.messages()[:6])
    n3 = len(prompt3) + len(
        sampled[2]
    )  # then context only: an end token if the reply was cut, the last user turn
    assert rows2[1].ids.tolist()[:n3] == prompt3 + sampled[2] and rows2[1].mask.sum() == len(sampled[2])
    assert not rows2[1].mask[n3:].any()
    batch = TrainBatch([traj, traj2], np.array([1.0, -1.0]))
    out = HFBackend(model, TrainConfig()).train_step(batch, TrainConfig())
    assert out["packed_rows"] == 3 and out["tokens"] == 2 * sum(len(s) for s in sampled)


async def test_reference_is_adapters_disabled_and_kl_grows() -> None:
    model = tiny()
    cfg = TrainConfig(lr=2e-2, kl_beta=0.1)
    backend = HFBackend(model, cfg)
    batch = batch_of(await sample_trajectories(model))
    first = backend.train_step(batch, cfg)
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)  # LoRA B starts at zero: policy == reference
    for _ in range(3):
        last = backend.train_step(batch, cfg)
    assert last["kl"] > 1e-6
    packed = backend.tokenize(batch, cfg)
    fresh = tiny()
    ref = backend.reference_logprobs(packed)
    base = HFBackend(fresh, cfg).train_logprobs(packed.ids)[0]
    assert np.abs(ref - base)[packed.mask].max() < 1e-5
    dpo = TrainConfig(lr=1e-2, objective="dpo")
    trajs = batch.trajectories
    out = HFBackend(model, dpo).train_step(
        TrainBatch(trajs, np.zeros(len(trajs)), pairs=[(1, 0), (3, 2)]), dpo
    )
    assert out["pairs"] == 2 and np.isfinite(out["loss"])


async def test_checkpoint_round_trip_resumes_bit_identically(tmp_path: Path) -> None:
    cfg = TrainConfig(lr=1e-2, minibatch_size=3)
    model = tiny()
    batch = batch_of(await sample_trajectories(model))
    backend = HFBackend(model, cfg)
    backend.train_step(batch, cfg)
    save_checkpoint(tmp_path / "ckpt.npz", {"backend": backend.state_dict()})
    backend.train_step(batch, cfg)
    expected = model.adapter_state()
    other = tiny()
    resumed = HFBackend(other, cfg)
    resumed.load_state_dict(load_checkpoint(tmp_path / "ckpt.npz")["backend"])
    assert other.step == 1
    resumed.train_step(batch, cfg)
    got = other.adapter_state()
    assert all(np.array_equal(got[k], expected[k]) for k in expected)
    # peft-format adapter folder (what vLLM loads) round-trips too
    model.save_adapter(tmp_path / "adapter")
    third = tiny()
    third.load_adapter(tmp_path / "adapter")
    ids = [[*model.render(PROMPTS[0]), 10, 20, 30]]
    assert np.array_equal(third.logprobs_of(ids)[0], model.logprobs_of(ids)[0])
    with pytest.raises(ValueError, match="format"):
        resumed.load_state_dict({"format": np.array("other")})


async def test_end_to_end_rollouts_through_the_app_and_grpo_trainer(hf_trainer_hook: None) -> None:
    from palaestra.envs.arithmetic_data import make_problem
    from palaestra.envs.rollouts import single_turn_rollout
    from palaestra.trainer.loop import GRPOTrainer
    from palaestra.trajectories.gather import gather_trajectory_groups

    model = tiny()
    trainer = GRPOTrainer(model, TrainConfig(lr=1e-2))
    assert isinstance(trainer.backend, HFBackend)
    examples = [make_problem(12, "+", 30), make_problem(7, "-", 9)]

    async def digits(group: TrajectoryGroup) -> TrajectoryGroup:  # a stand-in reward: share of digit chars
        for t in group.trajectories:
            text = t.last_assistant_text() or ""
            t.reward = sum(c.isdigit() for c in text) / max(len(text), 1)
        return group

    groups = [
        TrajectoryGroup(single_turn_rollout(model, ex, seed=100 * g + i, max_tokens=10) for i in range(4))
        for g, ex in enumerate(examples)
    ]
    groups = await gather_trajectory_groups(groups, after_each=digits, progress=False)
    result = await trainer.step(groups)
    assert result.updated and result.policy_step == 1 and result.metrics["tokens"] > 0
    resp = await model.openai_client().chat.completions.create(
        model=model.name, messages=PROMPTS[0], max_tokens=2
    )
    assert resp.system_fingerprint == "tiny-random-llama@step1"


def test_same_experiment_config_runs_embedded_and_hf(tmp_path: Path, hf_trainer_hook: None) -> None:
    from palaestra.trainer.experiment import Experiment

    def config(model: dict[str, Any], out: str) -> dict[str, Any]:
        return {
            "run": {
                "name": "swap",
                "output_dir": str(tmp_path / out),
                "groups_per_step": 2,
                "group_size": 4,
                "max_steps": 2,
                "progress": False,
                "samples_per_step": 2,
            },
            "model": model,
            "reward": {"kind": "simulated_judge"},  # noisy scores: every group has a signal
            "validation": {"every": 1, "max_examples": 4, "sampled": False},
            "env": {"max_tokens": 8},
            "train": {"lr": 1e-3},
            "stopping": {"patience": 10, "hacking_window": None, "collapse_window": None},  # run both steps
        }

    emb = Experiment(config({"name": "arith-base"}, "emb"), printer=None).run_sync()
    hf = Experiment(config({"backend": "hf", "name": "tiny-random-llama"}, "hf"), printer=None).run_sync()
    for s in (emb, hf):
        assert s["steps"] == 2 and s["stop"]["reason"] == "max_steps"
    history = [json.loads(x) for x in (tmp_path / "hf" / "history.jsonl").read_text().splitlines()]
    assert history[-1]["policy_version"] >= 2 and "train/loss" in history[-1]
    state = load_checkpoint(tmp_path / "hf" / "checkpoints" / "latest.npz")
    lora = [k for k in state["trainer"] if k.startswith("backend/lora/")]
    assert lora and all(isinstance(state["trainer"][k], np.ndarray) for k in lora)


def test_from_pretrained_local_folder_and_config_errors(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from palaestra.models.hf.tiny import build_char_tokenizer, tiny_config

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("tiny-random-qwen2", len(tok))).save_pretrained(
        tmp_path / "m"
    )
    tok.save_pretrained(tmp_path / "m")
    model = HFModel.from_config_section(
        str(tmp_path / "m"),
        {"device": "cpu", "dtype": "float32", "lora": {"r": 4, "target_modules": ["q_proj"]}},
    )
    assert model.name == "m" and model.card["lora"]["r"] == 4 and model.n_trainable > 0
    assert model.render(PROMPTS[0])[-1] == model.tokenizer.id_of("<|assistant|>")
    renamed = HFModel.from_config_section("tiny-random-qwen2", {"served_name": "policy", "seed": 3})
    assert renamed.name == "policy" and renamed.card["architecture"] == "Qwen2ForCausalLM"
    with pytest.raises(ValueError, match=r"model\.hf\.colour"):
        HFModel.from_config_section("tiny-random-llama", {"colour": "red"})


# ---------------------------------------------------------------------------------------------- vLLM shape
class _FakeVLLM:
    """Local stand-in for the HTTP shape of a vLLM server with runtime LoRA updating (NOT vLLM): records
    load/unload calls, refuses a second load of a name unless ``load_inplace`` (as older servers), and answers
    chat completions with ``token_id:<id>`` logprob tokens (``--return-tokens-as-token-ids``)."""

    def __init__(self, inplace: bool) -> None:
        self.inplace, self.calls, self.loaded, self.accepted = inplace, [], {}, []
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                return

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.calls.append((self.path, body))
                status, out = fake.handle(self.path, body)
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        name = body.get("lora_name")
        if path.endswith("/load_lora_adapter"):
            if name in self.loaded and not (self.inplace and body.get("load_inplace")):
                return 400, {"error": {"message": f"The lora adapter '{name}' has already been loaded."}}
            if not (Path(body["lora_path"]) / "adapter_model.safetensors").is_file():
                return 400, {"error": {"message": "no adapter"}}
            self.loaded[name] = body["lora_path"]
            self.accepted.append(body)
            return 200, {}
        if path.endswith("/unload_lora_adapter"):
            self.loaded.pop(name, None)
            return 200, {}
        assert body["model"] in self.loaded
        entries = [
            {"token": f"token_id:{t}", "logprob": -4.6, "bytes": None, "top_logprobs": []}
            for t in (40, 41, 2)
        ]
        choice = {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "HI"},
            "logprobs": {"content": entries},
        }
        return 200, {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [choice] * body.get("n", 1),
        }


@pytest.mark.parametrize("inplace", [True, False])
async def test_vllm_lora_push_http_shape(tmp_path: Path, inplace: bool) -> None:
    from palaestra.models.hf.vllm import VLLMLoRASync

    fake = _FakeVLLM(inplace)
    try:
        sync = VLLMLoRASync(base_url=fake.url, lora_dir=str(tmp_path / "loras"), keep=2)
        model = tiny(vllm=sync)
        resp = await model.openai_client().chat.completions.create(
            model=model.name, messages=PROMPTS[0], n=4, logprobs=True
        )
        trajs = [
            Trajectory(messages_and_choices=[*PROMPTS[0], c], reward=float(i % 2))
            for i, c in enumerate(resp.choices)
        ]
        backend = HFBackend(model, TrainConfig())
        for _ in range(3):
            backend.train_step(batch_of(trajs), TrainConfig())
        served = [b for b in fake.accepted if b["lora_name"] == "tiny-random-llama"]
        assert [Path(b["lora_path"]).name for b in served] == [f"step-00000{k}" for k in range(4)]
        staged = [b["lora_name"] for b in fake.accepted if b not in served]  # proven loadable before the swap
        assert staged == ([] if inplace else [f"tiny-random-llama--step-00000{k}" for k in range(1, 4)])
        assert fake.loaded.keys() == {"tiny-random-llama"}
        unloads = [p for p, _ in fake.calls if p.endswith("/unload_lora_adapter")]
        assert len(unloads) == (0 if inplace else 6)  # the served name, then the staging name, per update
        assert [h["servers"][0]["how"] for h in sync.history][1:] == [
            "load_inplace" if inplace else "unload+load"
        ] * 3
        assert sorted(p.name for p in (tmp_path / "loras").iterdir()) == ["step-000002", "step-000003"]
    finally:
        fake.httpd.shutdown()
        fake.httpd.server_close()


def test_start_column_skips_the_prompt_but_not_the_trained_tokens() -> None:
    """``train_logprobs(ids, start)`` runs the output layer from ``start`` on: the logprobs and the LoRA
    gradient of every column a row trains on are those of the full pass; earlier columns are 0."""
    backend = HFBackend(tiny(), TrainConfig())
    ids = np.random.default_rng(0).integers(3, backend.model.model.config.vocab_size, size=(3, 12))
    start = 5
    dlogp = np.zeros((3, 11))
    dlogp[:, start:] = np.random.default_rng(1).normal(size=(3, 11 - start))

    def grads(s: int) -> tuple[np.ndarray, list[np.ndarray]]:
        logp, _ = backend.train_logprobs(ids, s)
        backend.train_backward(dlogp)
        return logp, [p.grad.detach().numpy().copy() for p in backend.params.values() if p.grad is not None]

    full, g_full = grads(0)
    part, g_part = grads(start)
    assert np.all(part[:, :start] == 0.0)
    np.testing.assert_allclose(part[:, start:], full[:, start:], atol=1e-5)
    assert len(g_part) == len(g_full) > 0
    for a, b in zip(g_part, g_full, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_backend_refuses_bad_micro_batches_and_a_model_without_adapters() -> None:
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1 or None, got 0"):
        HFBackend(tiny(), TrainConfig(), micro_batch_size=0)
    frozen = tiny()
    for p in frozen.trainable_parameters().values():
        p.requires_grad_(False)  # e.g. a model loaded for inference, its adapters frozen
    with pytest.raises(ValueError, match=r"HFBackend: the model has no trainable \(LoRA\) parameters"):
        HFBackend(frozen, TrainConfig())


async def test_state_saved_before_the_first_update_resumes_bit_identically() -> None:
    """A checkpoint taken before any update holds no optimiser moments: loading it starts Adam afresh."""
    cfg = TrainConfig(lr=1e-2)
    model = tiny()
    batch = batch_of(await sample_trajectories(model, n=2))
    backend = HFBackend(model, cfg)
    state = backend.state_dict()
    assert not any(k.startswith("optim/") for k in state)
    backend.train_step(batch, cfg)
    expected = model.adapter_state()
    other = tiny()
    resumed = HFBackend(other, cfg)
    resumed.train_step(batch, cfg)  # moved LoRA weights and Adam moments, which the load must clear
    resumed.load_state_dict(state)
    assert other.step == 0
    resumed.train_step(batch, cfg)
    got = other.adapter_state()
    assert all(np.array_equal(got[k], expected[k]) for k in expected)


def test_vllm_publishing_a_step_again_replaces_its_folder(tmp_path: Path) -> None:
    from palaestra.models.hf.vllm import VLLMLoRASync

    fake = _FakeVLLM(inplace=True)
    try:
        sync = VLLMLoRASync(base_url=fake.url, lora_dir=str(tmp_path / "loras"))
        model = tiny()
        first = sync.publish(model, 5)
        (first / "stale.txt").write_text("from the first publish")
        again = sync.publish(model, 5)  # a resumed run publishes its step again
        assert again == first and not (again / "stale.txt").exists()
        assert (again / "adapter_model.safetensors").is_file()
        assert [b["lora_path"] for b in fake.accepted] == [str(first.resolve())] * 2
        assert [h["step"] for h in sync.history] == [5, 5]
    finally:
        fake.httpd.shutdown()
        fake.httpd.server_close()


def test_vllm_reload_refused_after_staging_is_a_publish_error(tmp_path: Path) -> None:
    """A server that accepts the staged adapter but then refuses it under the served name: the publish fails
    with the server's answer (it is not recorded as published)."""
    from palaestra.models.hf.vllm import LoRAPublishError, VLLMLoRASync

    class Sticky(_FakeVLLM):  # answers unload with 200 but keeps the adapter loaded
        def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            if path.endswith("/unload_lora_adapter"):
                return 200, {}
            return super().handle(path, body)

    fake = Sticky(inplace=False)
    try:
        sync = VLLMLoRASync(base_url=fake.url, lora_dir=str(tmp_path / "loras"))
        model = tiny()
        sync.publish(model, 1)
        message = r"load_lora_adapter 'tiny-random-llama' -> HTTP 400: .*has already been loaded"
        with pytest.raises(LoRAPublishError, match=message):
            sync.publish(model, 2)
        assert [h["step"] for h in sync.history] == [1]
        staged = [b["lora_name"] for b in fake.accepted]
        assert staged == ["tiny-random-llama", "tiny-random-llama--step-000002"]
    finally:
        fake.httpd.shutdown()
        fake.httpd.server_close()


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            {"dtype": "float8"},
            ValueError,
            r"dtype: expected one of \['bfloat16', 'float16', 'float32'\] or 'auto'",
        ),
        ({"lora": [8]}, TypeError, "lora must be a peft.LoraConfig, a dict or None, got list"),
        ({"micro_batch_size": 0}, ValueError, "micro_batch_size must be >= 1 or None, got 0"),
        (
            {"vllm": "http://x/v1"},
            ValueError,
            r"field 'model\.hf\.vllm': expected a table \(base_url, lora_dir",
        ),
        (
            {"vllm": {"base_url": "http://x/v1", "lora_dir": "l", "colour": 1}},
            ValueError,
            r"field 'model\.hf\.vllm': .*'colour'",
        ),
        (
            {"vllm": {"base_url": "ftp://x", "lora_dir": "l"}},
            ValueError,
            r"vllm\.base_url: expected http\(s\) URL\(s\), got 'ftp://x'",
        ),
        ({"vllm": {"base_url": [], "lora_dir": "l"}}, ValueError, r"vllm\.base_url: expected http\(s\) URL"),
        (
            {"vllm": {"base_url": "http://x/v1", "lora_dir": "l", "keep": 0}},
            ValueError,
            "vllm.keep: must be >= 1",
        ),
    ],
)
def test_config_section_refuses_bad_values_naming_them(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        HFModel.from_config_section("tiny-random-llama", options)


def test_tiny_names_lora_options_and_devices() -> None:
    from peft import LoraConfig

    from palaestra.models.hf.model import device_and_dtype

    with pytest.raises(
        KeyError, match=r"unknown tiny model 'tiny-random-nope'; available: tiny-llama-64, tiny-ran"
    ):
        HFModel.tiny("tiny-random-nope")
    short = tiny(lora={"r": 2, "alpha": 4, "dropout": 0.1, "target_modules": ["q_proj"]})  # short names
    assert short.card["lora"] == {"r": 2, "lora_alpha": 4, "lora_dropout": 0.1, "target_modules": ["q_proj"]}
    given = tiny(lora=LoraConfig(r=3, lora_alpha=6, target_modules=["v_proj"]))  # used as it is
    assert given.card["lora"] == {"r": 3, "lora_alpha": 6, "lora_dropout": 0.0, "target_modules": ["v_proj"]}
    with pytest.raises(TypeError, match="HFModel needs a peft model"):
        HFModel(torch.nn.Linear(2, 2), short.tokenizer, name="plain")
    assert device_and_dtype("cpu", torch.float64) == (torch.device("cpu"), torch.float64)
    assert device_and_dtype("cpu", "auto") == (torch.device("cpu"), torch.float32)  # bfloat16 only on a GPU
    if not torch.cuda.is_available():
        assert device_and_dtype(None, None) == (torch.device("cpu"), torch.float32)
        assert device_and_dtype("auto", "float16") == (torch.device("cpu"), torch.float16)


def test_adapter_state_and_files_are_checked(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = tiny()
    state = model.adapter_state()
    name = next(iter(state))
    with pytest.raises(ValueError, match=r"adapter state: missing \[.*\], unexpected \[\]"):
        model.load_adapter_state({k: v for k, v in state.items() if k != name})
    with pytest.raises(ValueError, match=r"adapter state: missing \[\], unexpected \['extra.lora_A'\]"):
        model.load_adapter_state({**state, "extra.lora_A": np.zeros(2)})
    with pytest.raises(
        ValueError, match=rf"adapter state '{re.escape(name)}': shape \(1,\), the model expects"
    ):
        model.load_adapter_state({**state, name: np.zeros(1)})
    with pytest.raises(
        FileNotFoundError, match=r"nowhere[/\\]adapter_model\.safetensors: no adapter weights"
    ):
        model.load_adapter(tmp_path / "nowhere")
    (tmp_path / "odd").mkdir()
    save_file(
        {"base_model.model.nowhere.lora_A.weight": torch.zeros(2, 2)},
        tmp_path / "odd" / "adapter_model.safetensors",
    )
    with pytest.raises(
        ValueError, match=r"adapter_model\.safetensors: unexpected adapter keys \[.*nowhere\.lora_A"
    ):
        model.load_adapter(tmp_path / "odd")


def test_chat_tokenizer_refuses_what_it_cannot_render() -> None:
    from openai.types.chat import ChatCompletionMessage

    from palaestra.models.hf import ChatTokenizer
    from palaestra.models.hf.tiny import build_char_tokenizer

    tok = tiny().tokenizer
    as_object = ChatCompletionMessage(role="assistant", content="Final: 4")  # what the openai client returns
    as_dict = {"role": "assistant", "content": "Final: 4"}
    assert tok.render([PROMPTS[0][0], as_object]).ids == tok.render([PROMPTS[0][0], as_dict]).ids
    with pytest.raises(ValueError, match=r"messages\[1\] must be a dict, got int"):
        tok.render([PROMPTS[0][0], 5])
    for msg in ({"content": "x"}, {"role": "", "content": "x"}, {"role": 3, "content": "x"}):
        with pytest.raises(ValueError, match=r"messages\[0\]: missing field 'role'"):
            tok.render([msg])
    bare = build_char_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template; pass chat_template="):
        ChatTokenizer(bare)
    no_eos = build_char_tokenizer()
    no_eos.eos_token = None
    with pytest.raises(ValueError, match=r"the tokenizer has no eos token; pass extra_end_ids=\[\.\.\.\]"):
        ChatTokenizer(no_eos)
    assert ChatTokenizer(no_eos, extra_end_ids=[2]).end_ids == frozenset({2})
