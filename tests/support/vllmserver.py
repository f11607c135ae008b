"""vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``) on 127.0.0.1 for a test module: the
reference our proxy is compared with (tests/e2e/test_bench_serve.py, test_e2e_vllm_lora.py). Started at once and
waited for later (``ready``), so that its start overlaps the module's other work; stopped by pid, with its engine
core (``stop``, which may be called more than once)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from llumnixctl.lab.ports import free_port


class VllmServer:
    """vLLM's OpenAI server on ``model`` with ``args`` (vLLM's command-line flags) and ``env`` (added to this
    process's environment), its output to ``log``."""

    def __init__(self, model: str | Path, log: Path, args: list[str], env: dict[str, str] | None = None):
        from llumnixctl.experiments.bench.engine import popen_api_server

        self.model = str(model)
        self.log = log
        self.url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING", **(env or {})}
        self.proc = popen_api_server(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host",
             "127.0.0.1", "--port", self.url.rsplit(":", 1)[1], *args], log, env)
        self.children: list[psutil.Process] = []

    def _note_children(self) -> None:
        try:
            self.children = psutil.Process(self.proc.pid).children(recursive=True) or self.children
        except psutil.Error:
            pass

    def ready(self, timeout_s: float = 180) -> "VllmServer":
        deadline = time.monotonic() + timeout_s
        while True:
            self._note_children()
            if self.proc.poll() is not None:
                pytest.fail(f"vLLM's server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM's server was not healthy within {timeout_s:g}s:\n{self.log.read_text()[-3000:]}")
            try:
                self.proc.wait(0.5)  # its exit, or half a second before asking /health again
            except subprocess.TimeoutExpired:
                pass

    def stop(self) -> None:
        """By pid: the server, then its engine core if it outlived it (as bench engine stops its own)."""
        from llumnixctl.experiments.bench.engine import stop_api_server

        self._note_children()
        stop_api_server(self.proc, self.children)
