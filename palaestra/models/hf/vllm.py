"""Scale-out inference: rollouts on vLLM servers holding the same base model (``model=<lora_name>``), the LoRA
adapters pushed to them after every update through ``POST {base_url}/load_lora_adapter``. Server flags and
setup: ``docs/scaling.md``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.models.remote import RemoteModel

if TYPE_CHECKING:
    from palaestra.models.hf.model import HFModel

__all__ = ["LoRAPublishError", "VLLMLoRASync"]


class LoRAPublishError(RuntimeError):
    """The vLLM server refused to load the adapters (its error message is included)."""


@dataclass
class VLLMLoRASync:
    """Pushes an HFModel's LoRA adapters to vLLM servers at ``base_url``: folders written under ``lora_dir``
    (seen by the servers as ``server_lora_dir`` if set; the newest ``keep`` are kept), served as ``lora_name``
    (default: the model's name)."""

    base_url: str | Sequence[str]
    lora_dir: str
    lora_name: str | None = None
    server_lora_dir: str | None = None
    keep: int = 2
    api_key_env: str | None = None
    timeout: float = 120.0
    load_inplace: bool = True
    history: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        urls = [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)
        if not urls or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"vllm.base_url: expected http(s) URL(s), got {self.base_url!r}")
        self._urls = [u.rstrip("/") for u in urls]
        if self.keep < 1:
            raise ValueError(f"vllm.keep: must be >= 1, got {self.keep}")
        self._lock = threading.Lock()
        self._remote: RemoteModel | None = None
        self._name: str | None = self.lora_name

    @property
    def published(self) -> bool:
        return bool(self.history)

    def _key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    def remote(self, model: HFModel) -> RemoteModel:
        """The :class:`RemoteModel` rollouts use (``model=<lora_name>``, round-robin over the servers)."""
        with self._lock:
            if self._remote is None:
                self._name = self._name or model.name
                self._remote = RemoteModel(
                    self._name, self._urls, api_key=self._key(), api_key_env=None, timeout=self.timeout
                )
            return self._remote

    def _post(self, client: Any, url: str, path: str, body: dict[str, Any]) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {self._key()}"} if self._key() else {}
        resp = client.post(f"{url}/{path}", json=body, headers=headers)
        return resp.status_code, resp.text

    def publish(self, model: HFModel, step: int) -> Path:
        """Save the adapters as ``lora_dir/step-<step>`` (atomically) and load them into every server;
        :class:`LoRAPublishError` if a server refuses (the adapter it was serving stays loaded)."""
        import httpx

        name = self._name = self._name or model.name
        root = Path(self.lora_dir)
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{step:06d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
        model.save_adapter(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        on_server = Path(self.server_lora_dir) / final.name if self.server_lora_dir else final.resolve()
        server_path = str(on_server)
        record: dict[str, Any] = {"step": step, "path": server_path, "servers": []}
        with httpx.Client(timeout=self.timeout) as client:
            for url in self._urls:
                body: dict[str, Any] = {"lora_name": name, "lora_path": server_path}
                if self.load_inplace:
                    body["load_inplace"] = True
                status, text = self._post(client, url, "load_lora_adapter", body)
                how = "load_inplace" if self.load_inplace else "load"
                if status >= 400:
                    status, text, how = self._swap(client, url, name, server_path, step, status, text)
                if status >= 400:
                    raise LoRAPublishError(
                        f"{url}: load_lora_adapter {name!r} -> HTTP {status}: {text[:300]}"
                    )
                record["servers"].append({"url": url, "status": status, "how": how})
        self.history.append(record)
        folders = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in folders[: max(0, len(folders) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _swap(
        self, client: Any, url: str, name: str, path: str, step: int, status: int, text: str
    ) -> tuple[int, str, str]:
        """After a refused load: load under a staging name first, and only when that works unload the served
        adapter and load it again from ``path``."""
        staging = f"{name}--step-{step:06d}"
        s2, t2 = self._post(client, url, "load_lora_adapter", {"lora_name": staging, "lora_path": path})
        if s2 >= 400:
            raise LoRAPublishError(
                f"{url}: load_lora_adapter {name!r} from {path} -> HTTP {status}: {text[:300]} (and under a "
                f"staging name: HTTP {s2}: {t2[:200]}); the adapter the server was serving is left in place"
            )
        try:
            self._post(client, url, "unload_lora_adapter", {"lora_name": name})
            s3, t3 = self._post(client, url, "load_lora_adapter", {"lora_name": name, "lora_path": path})
        finally:
            self._post(client, url, "unload_lora_adapter", {"lora_name": staging})
        return s3, t3, "unload+load"
