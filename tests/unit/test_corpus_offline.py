"""A Hugging Face hub source when the hub does not answer: a clear SourceError in seconds, not minutes of retries."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hlat.training.data.sources import hub_unreachable

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A port that accepts connections (the kernel's backlog) and never answers: a hub behind a dropping firewall."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def answering_endpoint() -> Iterator[str]:
    """An HTTP server that answers 404 to everything: reachable, whatever it says."""

    class NotFound(BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_probe_tells_an_answering_endpoint_from_a_closed_or_silent_one(
    answering_endpoint: str, silent_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    assert hub_unreachable(answering_endpoint) is None
    closed = f"http://127.0.0.1:{free_port()}"
    assert hub_unreachable(closed) == f"{closed}: ConnectionRefusedError: [Errno 111] Connection refused"
    why = hub_unreachable(silent_endpoint, timeout=1.0)
    assert why is not None and why.startswith(f"{silent_endpoint}: ") and "timed out" in why


# Run in a fresh interpreter: huggingface_hub and datasets read HF_ENDPOINT and HF_HUB_OFFLINE when imported, and
# the test session sets HF_HUB_OFFLINE=1 (tests/conftest.py).
SCRIPT = """
import json, sys, time
from hlat.training.data.sources import SourceError
from hlat.training.data.reader import plan_units, read_unit
from hlat.core.presets import load_config

cfg = load_config("tiny", {"data.source": "Salesforce/wikitext", "data.hf_config": "wikitext-2-raw-v1"}).data
start = time.monotonic()
try:
    [rows for unit in plan_units(cfg, 1 << 30) for rows in read_unit(unit, cfg)]
    message = None
except SourceError as exc:
    message = str(exc)
print(json.dumps({"seconds": time.monotonic() - start, "message": message}))
"""


@pytest.mark.parametrize("endpoint", ["closed", "silent"])
def test_an_unreachable_hub_fails_in_seconds_with_the_clear_message(
    endpoint: str, silent_endpoint: str, tmp_path: Path
) -> None:
    url = silent_endpoint if endpoint == "silent" else f"http://127.0.0.1:{free_port()}"
    drop = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.lower().endswith("_proxy")}
    env.update(HF_ENDPOINT=url, HF_HOME=str(tmp_path / "hf"), HF_DATASETS_CACHE=str(tmp_path / "hf" / "datasets"))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["message"] is not None, out.stderr[-3000:]
    assert result["message"].startswith(
        f"data.source: cannot reach the Hugging Face hub for 'Salesforce/wikitext' ({url}: "
    )
    assert "copy the data set to s3:// or a local folder" in result["message"]
    assert result["seconds"] < 15, result
