"""Test helper: a real headless Chromium driven over its DevTools protocol (a websocket, with the ``websockets`` package
the venv already has): nothing is downloaded at run time. Debian's ``chromium`` (``/usr/bin/chromium``) is enough;
:func:`chromium_path` is None where it is missing (the tests that need it skip, saying why)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class Browser:
    """One headless Chromium with one page; ``close()`` stops it (its own process group, by PID)."""

    def __init__(self, profile: Path, timeout: float = 60.0):
        from websockets.sync.client import connect

        self.timeout = timeout
        self.process = subprocess.Popen(
            [chromium_path(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--window-size=1280,900", "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port = self._port(profile / "DevToolsActivePort")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            page = next(t for t in json.loads(response.read()) if t["type"] == "page")
        self.socket = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=timeout)
        self.ids, self.events = 0, []
        self.call("Page.enable")

    def _port(self, path: Path) -> int:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if path.is_file() and path.read_text().strip():
                return int(path.read_text().splitlines()[0])
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.process.returncode}")
            time.sleep(0.2)
        raise TimeoutError("chromium did not open its DevTools port")

    def call(self, method: str, **params) -> dict:
        """Send one DevTools command and return its result (events that arrive meanwhile are kept)."""
        self.ids += 1
        self.socket.send(json.dumps({"id": self.ids, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=self.timeout))
            if message.get("id") == self.ids:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self.events.append(message)

    def _wait_load(self) -> None:
        deadline = time.monotonic() + self.timeout
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            if time.monotonic() > deadline:
                raise TimeoutError("the page did not load")
            self.events.append(json.loads(self.socket.recv(timeout=self.timeout)))
        self.events.clear()

    def goto(self, url: str) -> None:
        self.events.clear()
        self.call("Page.navigate", url=url)
        self._wait_load()

    def value(self, expression: str):
        """Evaluate a JavaScript expression in the page (as a person's actions: fill, click) and return its value."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def submit(self, expression: str) -> None:
        """Run ``expression`` (a click that submits a form) and wait for the next page to load."""
        self.events.clear()
        self.value(expression)
        self._wait_load()

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.socket.close()
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGTERM)
                try:
                    self.process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(self.process.pid, signal.SIGKILL)
                    self.process.wait(timeout=10)
