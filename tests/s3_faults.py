"""A storage fault injector for tests: an HTTP forwarding proxy on 127.0.0.1 in front of a moto S3 server, which a
job's AWS_ENDPOINT_URL points at, answering chosen requests with S3's own failures instead of forwarding them.

The moto server alone is kinder than S3: no latency, no throttling, no 5xx, no lost connection. S3 answers 503
SlowDown when a prefix's request rate is exceeded and 500 InternalError now and then, and asks clients to retry
both with back-off (https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html,
https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html); a multipart upload's part can fail alone
(https://docs.aws.amazon.com/AmazonS3/latest/userguide/mpuoverview.html). A `Rule` picks requests by operation
(PutObject, UploadPart, GetObject...) and key, and gives the first `times` of them (after letting `after` through)
one of the faults in FAULTS; every request is recorded, with what it got.

    with S3Faults(moto_endpoint) as proxy:
        proxy.add(Rule("PutObject", r"rank-00001\\.pt$", "slowdown", times=2))
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)

Path-style requests only (botocore uses them for an IP-address endpoint). Bodies are read whole (Content-Length or
HTTP chunked) and forwarded with their length; one upstream connection per request.
"""

from __future__ import annotations

import http.client
import re
import socket
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ERRORS = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "internal": (500, "InternalError", "We encountered an internal error. Please try again."),
    "denied": (403, "AccessDenied", "Access Denied"),
}
"""Fault -> (status, S3 error code, message), as S3 words them (ErrorResponses, above)."""
FAULTS = (*ERRORS, "drop", "latency")
"""`drop`: the connection is closed without an answer (the body read first); `latency`: forwarded `seconds` late."""
UPSTREAM_TIMEOUT_S = 60.0


def operation(method: str, key: str, query: dict[str, list[str]], headers: Any) -> str:
    """The S3 API operation of a path-style request (https://docs.aws.amazon.com/AmazonS3/latest/API/)."""
    if method == "PUT" and key:
        if "partNumber" in query and "uploadId" in query:
            return "UploadPartCopy" if "x-amz-copy-source" in headers else "UploadPart"
        return "CopyObject" if "x-amz-copy-source" in headers else "PutObject"
    if method == "POST" and key:
        if "uploads" in query:
            return "CreateMultipartUpload"
        if "uploadId" in query:
            return "CompleteMultipartUpload"
    if method == "POST" and "delete" in query:
        return "DeleteObjects"
    if method == "DELETE" and key:
        return "AbortMultipartUpload" if "uploadId" in query else "DeleteObject"
    if method == "GET" and key:
        return "ListParts" if "uploadId" in query else "GetObject"
    if method == "HEAD":
        return "HeadObject" if key else "HeadBucket"
    if method == "GET":
        return "ListMultipartUploads" if "uploads" in query else "ListObjectsV2"
    return f"{method} {'object' if key else 'bucket'}"


@dataclass
class Rule:
    """Give `fault` to the matching requests: `operations` (one name or several; None: any), `key` (a regex
    searched in the object key; None: any), the first `times` of them (None: every one) after `after` went through."""

    operations: str | tuple[str, ...] | None
    key: str | None
    fault: str
    times: int | None = 1
    after: int = 0
    seconds: float = 0.0
    """`latency`'s delay."""
    seen: int = 0
    hits: list[tuple[float, str, str]] = field(default_factory=list)
    """(time.time(), operation, key) of each request it faulted."""

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"fault {self.fault!r}: expected one of {FAULTS}")

    def wants(self, op: str, key: str) -> bool:
        """Whether this request gets the fault (counting it when it matches)."""
        names = (self.operations,) if isinstance(self.operations, str) else self.operations
        if (names is not None and op not in names) or (self.key is not None and not re.search(self.key, key)):
            return False
        self.seen += 1
        if self.seen <= self.after or (self.times is not None and len(self.hits) >= self.times):
            return False
        self.hits.append((time.time(), op, key))
        return True


@dataclass(frozen=True)
class Request:
    at: float
    operation: str
    key: str
    status: int | str
    """The status code answered, or 'dropped'."""


class S3Faults:
    """The proxy: `url` is its endpoint; `add` a Rule at any time; `requests` is what went through."""

    def __init__(self, upstream: str) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.rules: list[Rule] = []
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        owner = self

        class Handler(_Forwarder):
            proxy = owner

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> S3Faults:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def fault_for(self, op: str, key: str) -> Rule | None:
        with self._lock:
            return next((rule for rule in self.rules if rule.wants(op, key)), None)

    def record(self, op: str, key: str, status: int | str) -> None:
        with self._lock:
            self.requests.append(Request(time.time(), op, key, status))


class _Forwarder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as botocore's connection pool expects
    proxy: S3Faults

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def _body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self) -> None:
        parts = urllib.parse.urlsplit(self.path)
        _, _, key = parts.path.lstrip("/").partition("/")
        key = urllib.parse.unquote(key)
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
        op = operation(self.command, key, query, self.headers)
        body = self._body()
        rule = self.proxy.fault_for(op, key)
        if rule is not None and rule.fault == "drop":
            self.proxy.record(op, key, "dropped")
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if rule is not None and rule.fault in ERRORS:
            status, code, message = ERRORS[rule.fault]
            request_id = uuid.uuid4().hex[:16].upper()
            xml = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
                f"<Key>{key}</Key><RequestId>{request_id}</RequestId></Error>"
            ).encode()
            self.proxy.record(op, key, status)
            self.send_response_only(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("x-amz-request-id", request_id)
            self.send_header("Content-Length", str(len(xml) if self.command != "HEAD" else 0))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(xml)
            return
        if rule is not None and rule.fault == "latency":
            time.sleep(rule.seconds)
        status, headers, answer = self._upstream(body)
        self.proxy.record(op, key, status)
        self.send_response_only(status)
        for name, value in headers:
            if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(name, value)
        length = dict((n.lower(), v) for n, v in headers).get("content-length")
        self.send_header("Content-Length", length if self.command == "HEAD" and length else str(len(answer)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(answer)

    def _upstream(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        host, port = self.proxy.upstream
        conn = http.client.HTTPConnection(host, port, timeout=UPSTREAM_TIMEOUT_S)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                    conn.putheader(name, value)
            if body or self.command in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            response = conn.getresponse()
            answer = response.read()
            return response.status, response.getheaders(), answer
        finally:
            conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
