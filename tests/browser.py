"""A headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
JSON messages, each ended by a NUL byte, on file descriptors 3 and 4), so that a test can read
what a page shows, shadow DOM included (TensorBoard's dashboards are web components, which
``--dump-dom`` leaves out), with nothing but the system's browser and the standard library.

The browser resolves no host but 127.0.0.1 (``--host-resolver-rules``): a page that needs the
internet fails here as it would on a cluster without it.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")

# the text of every element matching a CSS selector, in the page and in every shadow root
DEEP_QUERY = """(selector, read) => {
  const out = [];
  const walk = (root) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.matches(selector)) out.push(read(el));
      if (el.shadowRoot) walk(el.shadowRoot);
    }
  };
  walk(document);
  return out;
}"""


def find_chromium() -> str | None:
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless browser process with one page; ``close()`` kills it by its PID."""

    def __init__(self, exe: str, profile_dir: Path):
        to_browser = os.pipe()
        from_browser = os.pipe()
        reads, writes = to_browser[0], from_browser[1]

        def onto_3_and_4() -> None:  # in the child, before exec; via fds above 9, as either
            r = fcntl.fcntl(reads, fcntl.F_DUPFD, 10)  # pipe end may itself be 3 or 4
            w = fcntl.fcntl(writes, fcntl.F_DUPFD, 10)
            os.dup2(r, 3)
            os.dup2(w, 4)

        self.proc = subprocess.Popen(
            [
                exe,
                "--headless",
                "--no-sandbox",  # CI runs as root
                "--disable-gpu",
                "--remote-debugging-pipe",
                f"--user-data-dir={profile_dir}",
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
                "--window-size=1280,1000",
                "about:blank",
            ],
            preexec_fn=onto_3_and_4,
            pass_fds=(3, 4, reads, writes),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(reads)
        os.close(writes)
        self.out = os.fdopen(to_browser[1], "wb", buffering=0)
        self.inp = os.fdopen(from_browser[0], "rb", buffering=0)
        self.pending = b""
        self.last_id = 0
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]

    def send(self, method: str, session: str | None = None, **params: Any) -> dict:
        """One command; its result (events that arrive meanwhile are dropped)."""
        self.last_id += 1
        msg: dict[str, Any] = {"id": self.last_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        self.out.write(json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self.pending:
                chunk = self.inp.read(1 << 16)
                if not chunk:
                    raise RuntimeError(f"the browser closed its pipe (exit {self.proc.poll()})")
                self.pending += chunk
            raw, self.pending = self.pending.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.last_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def page(self, method: str, **params: Any) -> dict:
        return self.send(method, self.session, **params)

    def open(self, url: str) -> None:
        self.page("Page.navigate", url=url)

    def deep(self, selector: str, read: str) -> list:
        """``read(el)`` (a JavaScript arrow function) of every element matching ``selector``."""
        expr = f"({DEEP_QUERY})({json.dumps(selector)}, {read})"
        result = self.page("Runtime.evaluate", expression=expr, returnByValue=True)
        return result["result"].get("value") or []

    def wait_for(self, selector: str, read: str, ok, timeout: float = 60.0) -> list:
        """Poll ``deep`` until ``ok(values)``; the last values either way."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.deep(selector, read)
            if ok(values) or time.monotonic() > deadline:
                return values
            time.sleep(0.25)

    def screenshot(self, path: Path) -> bytes:
        png = base64.b64decode(self.page("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(png)
        return png

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.out.close()
        self.inp.close()
