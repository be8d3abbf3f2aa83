"""A real ``ssr serve`` process on 127.0.0.1 and a free port, for the server tests: started, waited for, stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from servers import free_port


class ServerProcess:
    """``python -m ssr.cli serve ARGS --port <free>``; ``url`` is ``http://127.0.0.1:<port>``, its log in ``log``."""

    def __init__(self, args: list[str], log: Path, api_key: str | None = None, startup: float = 240.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = Path(log)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        env.pop("SSR_API_KEY", None)
        if api_key is not None:
            env["SSR_API_KEY"] = api_key  # the key from the environment, as a deployment gives it
        self._log_file = open(self.log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "ssr.cli", "serve", *args, "--port", str(self.port)],
                                     stdout=self._log_file, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait(startup)
        except BaseException:
            self.stop()
            raise

    def _wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ssr serve exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"ssr serve did not answer /health within {seconds} s:\n{self.log_text()[-4000:]}")

    def log_text(self) -> str:
        self._log_file.flush()
        return self.log.read_text(errors="replace")

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def health(self) -> dict:
        return json.loads(self.get("/health")[1])

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of ``GET /metrics`` (0 when absent)."""
        for line in self.get("/metrics")[1].splitlines():
            if line.startswith(f"{name}{labels} "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log_file.close()
