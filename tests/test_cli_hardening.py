"""CLI and config hardening (issue 16, items 13, 16, 17, 18): bounds checked before any file is written,
``train`` errors in one line with exit code 2 and no half-made run folder, an end-of-run table, ``inspect``
taking the run positionally, ``gate`` on a training run, ``serve`` on a busy port, the guide's commands
parsing as written, subpackages reachable from ``import palaestra``, and a vLLM LoRA sync that never leaves a
server without its adapter."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import socket
import struct
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from palaestra.trainer.expconfig import MAX_GROUP_SIZE, config_from_dict
from palaestra.trainer.experiment import Experiment
from palaestra.trajectories.io import DataError

ROOT = Path(__file__).resolve().parents[1]


def small(model: Path, out: Path, **run: Any) -> dict[str, Any]:
    return {
        "run": {
            "name": "cli",
            "seed": 1,
            "output_dir": str(out),
            "groups_per_step": 2,
            "group_size": 3,
            "max_steps": 2,
            "progress": False,
            **run,
        },
        "model": {"name": str(model)},
        "env": {"max_tokens": 5},
        "reward": {"kind": "simulated_judge"},
        "validation": {"every": 1, "max_examples": 6},
        "stopping": {"patience": 1},
    }


def toml_of(cfg: dict[str, Any]) -> str:
    lines = []
    for section, values in cfg.items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"{k} = {json.dumps(v)}" if not isinstance(v, bool) else f"{k} = {str(v).lower()}")
    return "\n".join(lines) + "\n"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``palaestra ARGS`` in this process (the real CLI entry point; argparse exits become exit codes)."""
    from palaestra.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["palaestra", *args], code, out.getvalue(), err.getvalue())


def one_line_rc2(proc: subprocess.CompletedProcess[str], command: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"palaestra {command}: error:"), proc.stderr
    return lines[0]


# ---- item 13: one source of truth per bound, checked before any file is written ----------------------------
@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"run": {"group_size": MAX_GROUP_SIZE + 1}}, "run.group_size"),
        ({"run": {"groups_per_step": 10**11}}, "run.groups_per_step"),
        ({"reward": {"simulated": {"noise": float("inf")}}}, "reward.simulated.noise"),
        ({"reward": {"simulated": {"position_bias": float("nan")}}}, "reward.simulated.position_bias"),
        ({"env": {"options": {"scale": float("nan")}}}, "env.options.scale"),
        ({"train": {"lr": float("inf")}}, "train.lr"),
        ({"run": {"max_steps": 0}}, "run.max_steps"),
    ],
)
def test_bad_values_are_refused_naming_file_and_field(patch: dict[str, Any], field: str) -> None:
    with pytest.raises(DataError, match=rf"^exp\.toml: .*field '{re.escape(field)}'"):
        config_from_dict(patch, source="exp.toml")


def test_group_size_bound_is_the_servers_n_limit(tmp_path: Path) -> None:
    """The largest group_size the config accepts is the largest n the embedded server samples in one request."""
    import asyncio

    import openai

    from palaestra.models.registry import load

    config_from_dict({"run": {"group_size": MAX_GROUP_SIZE}})
    client = load("arith-base").openai_client()
    msgs: Any = [{"role": "user", "content": "What is 1+1? Reply with one line: Final: <int>"}]

    async def ask(n: int) -> int:
        resp = await client.chat.completions.create(model="arith-base", messages=msgs, n=n, max_tokens=2)
        return len(resp.choices)

    assert asyncio.run(ask(MAX_GROUP_SIZE)) == MAX_GROUP_SIZE
    with pytest.raises(openai.BadRequestError):
        asyncio.run(ask(MAX_GROUP_SIZE + 1))


def test_unknown_env_options_are_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    cfg = small(tiny_model_path, tmp_path / "a")
    cfg["env"]["options"] = {"colour": "red"}
    with pytest.raises(DataError, match=r"field 'env\.options\.colour': unknown option"):
        Experiment(cfg, printer=None)
    cfg["env"]["options"] = {"seed": 3}  # would silently give every rollout the same seed
    with pytest.raises(DataError, match=r"field 'env\.options\.seed'"):
        Experiment(cfg, printer=None)
    calc = {**cfg, "env": {"name": "calculator", "max_tokens": 8, "options": {"max_turns": 2}}}
    calc["model"] = {"name": "calc-base"}
    Experiment(calc, printer=None)  # an option the calculator's rollout takes
    assert not (tmp_path / "a").exists()


def test_bad_cli_values_write_nothing(tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = small(tiny_model_path, out)
    (tmp_path / "exp.toml").write_text(toml_of(cfg))
    for steps in ("0", "-3"):
        proc = cli("train", "--config", str(tmp_path / "exp.toml"), "--max-steps", steps)
        assert proc.returncode == 2 and "--max-steps" in proc.stderr
    cfg["run"]["group_size"] = 129
    (tmp_path / "bad.toml").write_text(toml_of(cfg))
    line = one_line_rc2(cli("train", "--config", str(tmp_path / "bad.toml")), "train")
    assert "bad.toml" in line and "run.group_size" in line
    assert not out.exists()


@pytest.fixture(scope="module")
def plateau_run(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run whose stopping rule (plateau: a random policy never improves) ended it."""
    out = tmp_path_factory.mktemp("plateau") / "run"
    summary = Experiment(small(tiny_model_path, out, max_steps=6), printer=None).run_sync()
    assert summary["stop"]["reason"] == "plateau", summary["stop"]
    return out


def test_max_steps_on_resume_extends_or_is_refused(
    tiny_model_path: Path, tmp_path: Path, plateau_run: Path
) -> None:
    # a run its stopping rule ended is not silently "extended" (nor silently ignored)
    line = one_line_rc2(cli("train", "--resume", str(plateau_run), "--max-steps", "20"), "train")
    assert "plateau" in line and "--max-steps" in line
    # a run that stopped on its step budget goes on to the new one, recorded in config.json
    out = tmp_path / "budget"
    cfg = small(tiny_model_path, out, max_steps=2)
    cfg["stopping"]["patience"] = 50
    assert Experiment(cfg, printer=None).run_sync()["stop"]["reason"] == "max_steps"
    summary = Experiment.resume(out, max_steps=4, printer=None).run_sync()
    assert summary["steps"] == 4 and summary["stop"]["reason"] == "max_steps"
    assert json.loads((out / "config.json").read_text())["run"]["max_steps"] == 4
    with pytest.raises(DataError, match="already has 4 steps"):
        Experiment.resume(out, max_steps=3, printer=None).run_sync()


def test_resume_honours_quiet_and_refuses_output_dir(tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = small(tiny_model_path, out, max_steps=1, progress=True)
    cfg["stopping"]["patience"] = 50
    (tmp_path / "exp.toml").write_text(toml_of(cfg))
    first = cli("train", "--config", str(tmp_path / "exp.toml"))
    assert first.returncode == 0, first.stderr
    assert re.search(r"^step +1 .* kept \d+ ", first.stdout, re.M), first.stdout  # counts print as ints
    assert not re.search(r"kept \d+\.\d", first.stdout)
    line = one_line_rc2(
        cli("train", "--resume", str(out), "--output-dir", str(tmp_path / "elsewhere")), "train"
    )
    assert "--output-dir" in line and not (tmp_path / "elsewhere").exists()
    quiet = cli("train", "--resume", str(out), "--max-steps", "2", "--quiet")
    assert quiet.returncode == 0, quiet.stderr
    assert not re.search(r"^step +\d", quiet.stdout, re.M) and "resumed" not in quiet.stdout


# ---- item 16: train errors in one line, no half-made folder; a table at the end ----------------------------
def test_train_unknown_model_is_one_line_and_leaves_no_folder(tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = small(tiny_model_path, out)
    cfg["model"]["name"] = "no-such-model"
    (tmp_path / "exp.toml").write_text(toml_of(cfg))
    line = one_line_rc2(cli("train", "--config", str(tmp_path / "exp.toml")), "train")
    assert "no-such-model" in line
    assert not out.exists()
    # an output folder that already existed (with the user's own files) keeps them, and only them
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    one_line_rc2(cli("train", "--config", str(tmp_path / "exp.toml")), "train")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_train_judge_400_is_one_line_and_leaves_no_folder(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from palaestra.testing import Reply, ScriptedServer

    out = tmp_path / "run"
    refused = Reply(None, status=400, raw_body='{"error": {"message": "no such model", "type": "invalid"}}')
    with ScriptedServer(lambda req, n: refused) as server:
        cfg = small(tiny_model_path, out)
        cfg["reward"] = {
            "kind": "judge",
            "judge_model": "m",
            "judge_base_url": server.base_url,
            "judge_api_key_env": "PALAESTRA_TEST_KEY",
            "judge_max_retries": 0,
        }
        (tmp_path / "exp.toml").write_text(toml_of(cfg))
        monkeypatch.setenv("PALAESTRA_TEST_KEY", "sk-test")
        proc = cli("train", "--config", str(tmp_path / "exp.toml"))
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("palaestra train: error:")]
    assert len(errors) == 1 and "400" in errors[0] and "Traceback" not in proc.stderr
    assert not out.exists()


def test_scripted_server_is_quiet_when_a_client_hangs_up() -> None:
    """A client that resets its connection (as one closing with a reply unread does) makes the stand-in
    server's thread print nothing: sys.stderr is process-wide, and ``cli`` above captures it while a run's judge
    connections (and those of earlier tests) may be closed."""
    from palaestra.testing import Reply, ScriptedServer

    raw = '{"error": {"message": "no such model", "type": "invalid"}}'
    refused = Reply(None, status=400, raw_body=raw)
    body = json.dumps({"model": "m", "messages": []}).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    err = io.StringIO()
    with ScriptedServer(lambda req, n: refused) as server, contextlib.redirect_stderr(err):
        before = set(threading.enumerate())
        port = int(server.base_url.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(head.encode() + body)
            reply = b""
            while not reply.endswith(raw.encode()):  # the whole reply: the server is done with it
                chunk = sock.recv(4096)
                assert chunk, reply
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 400")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: a reset
        for handler in set(threading.enumerate()) - before:
            handler.join(10)
            assert not handler.is_alive()
    assert server.calls == 1 and err.getvalue() == ""


def test_train_prints_a_table_not_json(tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    (tmp_path / "exp.toml").write_text(toml_of(small(tiny_model_path, out, max_steps=1)))
    proc = cli("train", "--config", str(tmp_path / "exp.toml"))
    assert proc.returncode == 0, proc.stderr
    assert "{" not in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"run folder +{re.escape(str(out))}", last), last
    assert re.search(r"^stop +\w+ at step \d+", proc.stdout, re.M)


# ---- item 17: inspect, gate, serve, the guide ---------------------------------------------------------------
@pytest.fixture(scope="module")
def eval_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A frozen-completions eval run on five test questions (Loop A)."""
    root = tmp_path_factory.mktemp("eval")
    with open(ROOT / "palaestra/envs/data/arithmetic/test.jsonl") as fh:
        rows = [json.loads(line) for _, line in zip(range(5), fh)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "completions.jsonl").write_text(
        "".join(json.dumps({"id": r["id"], "completion": "Final: 7"}) + "\n" for r in rows)
    )
    done = cli(
        "eval", "--dataset", str(root / "data.jsonl"), "--completions", str(root / "completions.jsonl"),
        "--outdir", str(root / "ev"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return root / "ev"


def test_inspect_takes_the_run_positionally_and_as_option(eval_run: Path) -> None:
    positional, option = cli("inspect", str(eval_run)), cli("inspect", "--run", str(eval_run))
    assert positional.returncode == 0 and option.returncode == 0, (positional.stderr, option.stderr)
    assert positional.stdout == option.stdout and positional.stdout.strip()
    one_line_rc2(cli("inspect"), "inspect")


def test_gate_on_a_training_run_says_it_needs_eval_runs(eval_run: Path, plateau_run: Path) -> None:
    proc = cli("gate", "--baseline", str(eval_run), "--candidate", str(plateau_run), "--min-delta", "0")
    line = one_line_rc2(proc, "gate")
    assert "training run" in line and "palaestra eval" in line and "candidate" in line


def test_serve_on_a_busy_port_fails_before_printing_its_url() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "palaestra", "serve", "--model", "arith-base", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    line = one_line_rc2(proc, "serve")
    assert str(port) in line and "http://" not in proc.stdout


def guide_commands() -> list[list[str]]:
    text = (ROOT / "docs" / "guide.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split("#", 1)[0].strip().rstrip("&").strip()
            if line.startswith("palaestra "):
                out.append(shlex.split(line)[1:])
    return out


def test_every_palaestra_command_in_the_guide_parses_as_written() -> None:
    from palaestra.cli import build_parser

    commands = guide_commands()
    assert len(commands) >= 10
    parser = build_parser()
    for argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit as exc:  # argparse: unknown or missing options
            if exc.code != 0:
                raise AssertionError(f"docs/guide.md: `palaestra {' '.join(argv)}` does not parse") from None


# ---- item 18: subpackages from the lazy top level; numpy bound; vLLM LoRA sync ------------------------------
def test_subpackages_are_reachable_from_import_palaestra() -> None:
    code = (
        "import sys, palaestra\n"
        "assert 'numpy' not in sys.modules\n"
        "m = palaestra.models.load('arith-base')\n"
        "print(m.name, palaestra.trainer.Experiment.__name__, palaestra.evals.__name__, palaestra.judges.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["arith-base", "Experiment", "palaestra.evals", "palaestra.judges"]


def test_numpy_lower_bound_covers_the_numpy_used() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    bound = re.search(r'"numpy>=(\d+)\.(\d+)', pyproject)
    assert bound, "numpy must be declared with a lower bound"
    uses_vecdot = any("np.vecdot" in p.read_text() for p in (ROOT / "palaestra").rglob("*.py"))
    if uses_vecdot:  # np.vecdot arrived in numpy 2.0
        assert (int(bound.group(1)), int(bound.group(2))) >= (2, 0)


class FakeVLLM:
    """A local HTTP server speaking vLLM's runtime LoRA endpoints (NOT vLLM): an adapter loads only from a
    folder holding ``adapter_model.safetensors``; ``inplace`` decides whether a loaded name may be reloaded."""

    def __init__(self, inplace: bool) -> None:
        self.inplace = inplace
        self.loaded: dict[str, str] = {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, out = fake.handle(self.path, body)
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        name = str(body.get("lora_name"))
        if path.endswith("/load_lora_adapter"):
            if name in self.loaded and not (self.inplace and body.get("load_inplace")):
                return 400, {"error": {"message": f"The lora adapter '{name}' has already been loaded."}}
            if not (Path(body["lora_path"]) / "adapter_model.safetensors").is_file():
                return 400, {"error": {"message": f"No adapter found for {body['lora_path']}"}}
            self.loaded[name] = body["lora_path"]
            return 200, {}
        if path.endswith("/unload_lora_adapter"):
            if name not in self.loaded:
                return 404, {"error": {"message": "not loaded"}}
            del self.loaded[name]
            return 200, {}
        return 404, {}


class AdapterWriter:
    """What VLLMLoRASync.publish needs of a model: a served name and ``save_adapter(folder)``."""

    name = "policy"

    def save_adapter(self, folder: Path) -> None:
        (Path(folder) / "adapter_model.safetensors").write_bytes(b"weights")
        (Path(folder) / "adapter_config.json").write_text("{}")


@pytest.mark.parametrize("inplace", [True, False])
def test_vllm_refused_adapter_leaves_the_served_one_loaded(tmp_path: Path, inplace: bool) -> None:
    from palaestra.models.hf.vllm import LoRAPublishError, VLLMLoRASync

    fake = FakeVLLM(inplace)
    try:
        sync = VLLMLoRASync(base_url=fake.url, lora_dir=str(tmp_path / "loras"))
        model = AdapterWriter()
        sync.publish(model, 1)  # type: ignore[arg-type]
        sync.publish(model, 2)  # type: ignore[arg-type]  # a good update: in place, or staged then swapped
        assert fake.loaded == {"policy": str((tmp_path / "loras" / "step-000002").resolve())}
        served = dict(fake.loaded)
        sync.server_lora_dir = str(tmp_path / "not-mounted-on-the-server")  # a path the server cannot read
        with pytest.raises(LoRAPublishError, match="left in place"):
            sync.publish(model, 3)  # type: ignore[arg-type]
        assert fake.loaded == served  # still serving step 2, no staging adapter left behind
    finally:
        fake.httpd.shutdown()
        fake.httpd.server_close()
