"""Start a real ``treeverify serve`` subprocess on loopback (tests, local experiments).

with ServerProcess(["--model", "tiny-llama"]) as srv:
    httpx.get(srv.url + "/health")
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import treeverify


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m treeverify.server.cli serve ARGS --port <free>``; waits for /health."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        startup_timeout: float = 60.0,
        api_key: str | None = None,
    ) -> None:
        """``api_key``: the server's bearer key, passed as TREEVERIFY_API_KEY (an argument would
        show in ``ps``); ``headers`` carries it for clients."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args, self.startup_timeout = list(args), startup_timeout
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        src = str(Path(treeverify.__file__).resolve().parents[1])
        self.env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.env.update(env or {})
        if api_key is not None:
            self.env["TREEVERIFY_API_KEY"] = api_key
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def start(self) -> ServerProcess:
        import tempfile

        import httpx

        fd, path = tempfile.mkstemp(prefix="treeverify-serve-", suffix=".log")
        self.log_path = Path(path)
        cmd = [
            sys.executable,
            "-m",
            "treeverify.server.cli",
            "serve",
            *self.args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=fd, stderr=subprocess.STDOUT)
        os.close(fd)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:  # open route
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"server not healthy after {self.startup_timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
