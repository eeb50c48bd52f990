"""Start and stop real SGLang servers (CPU, the real SmolLM2 model) for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import requests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from benchmarks.ports import free_port, with_nccl_port  # noqa: E402
MODEL_DIR = os.environ.get("SGLANG_EXT_MODEL_DIR", os.path.join(REPO, ".models", "smollm2"))
LABELS = os.path.join(MODEL_DIR, "sparse_labels.json")
# the same labels as the leading coordinates of a calibrated q/k basis (make model)
LABELS_BASIS = os.path.join(MODEL_DIR, "sparse_labels_kpca.json")

# The CPU launch that works on 2-core machines: a small KV pool (the default would take
# ~16 GB) and an idle scheduler that sleeps instead of spinning a core.
CPU_ARGS = ["--device", "cpu", "--max-total-tokens", "16384", "--sleep-on-idle"]


def server_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env.pop("TRITON_INTERPRET", None)  # set by conftest for the kernel tests, not for servers
    env["SGLANG_USE_CPU_ENGINE"] = "1"  # without it the rotary embedding imports vLLM ops
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def launch_command(args: list[str], port: int) -> list[str]:
    return [
        sys.executable, "-m", "sglang.launch_server", "--model-path", MODEL_DIR,
        "--host", "127.0.0.1", "--port", str(port), *with_nccl_port([*CPU_ARGS, *args]),
    ]


@dataclass
class Server:
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    process: Optional[subprocess.Popen] = None
    log_path: str = ""
    # what answers once the server serves (a decode-only server has no test generation)
    health_path: str = "/health_generate"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 420.0) -> "Server":
        fd, self.log_path = tempfile.mkstemp(prefix="sglang_ext_server_", suffix=".log")
        log = os.fdopen(fd, "w")
        self.process = subprocess.Popen(
            launch_command(self.args, self.port), stdout=log, stderr=subprocess.STDOUT,
            env=server_env(self.env), start_new_session=True,
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + self.health_path, timeout=30).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(2)
        self.stop()
        raise TimeoutError(f"server did not become healthy in {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def log_text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def generate(self, text: Any, max_new_tokens: int = 16, **sampling: Any) -> Any:
        payload = {
            "text": text,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling},
        }
        r = requests.post(self.url + "/generate", json=payload, timeout=600)
        r.raise_for_status()
        return r.json()
