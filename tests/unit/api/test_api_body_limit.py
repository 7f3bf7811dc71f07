"""The body bound holds however a body is sent: uvicorn on loopback, raw HTTP/1.1 over a socket."""

from __future__ import annotations

import json
import select
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from api_fakes import TOKEN, FakeBackend, admin

from cmx.api.app import MAX_BODY_BYTES, create_app
from cmx.api.server import ServerThread

CHUNK = 64 << 10
LAYOUT: dict[str, Any] = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 4}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    app = create_app(FakeBackend, admin(), sample_in_background=False)
    srv = ServerThread(app, "127.0.0.1", 0).start()
    yield srv
    srv.stop()


def head(server: ServerThread, extra: str) -> bytes:
    return (f"POST /api/v1/lookup HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\n{extra}\r\n").encode()


def exchange(server: ServerThread, request: bytes, chunks: Iterator[bytes]) -> tuple[int, int,
                                                                                      bytes]:
    """Send ``request`` then ``chunks`` until the server answers; (sent body bytes, status,
    response body). Stops sending as soon as an answer is readable."""
    sent = 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        for chunk in chunks:
            if select.select([sock], [], [], 0)[0]:
                break
            try:
                sock.sendall(chunk)
            except OSError:  # the server closed its side after answering
                break
            sent += len(chunk)
        answer = b""
        while b"\r\n\r\n" not in answer or not _complete(answer):
            data = sock.recv(1 << 16)
            if not data:
                break
            answer += data
    status = int(answer.split(b" ", 2)[1])
    return sent, status, answer.partition(b"\r\n\r\n")[2]


def _complete(answer: bytes) -> bool:
    header, _, body = answer.partition(b"\r\n\r\n")
    for line in header.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def chunked(total: int) -> Iterator[bytes]:
    """``total`` bytes of a JSON array as HTTP/1.1 chunks, then the last chunk."""
    body = b"[" + b"0," * (CHUNK // 2)
    sent = 0
    while sent < total:
        yield b"%x\r\n%s\r\n" % (len(body), body)
        sent += len(body)
    yield b"0\r\n\r\n"


def problem_of(body: bytes) -> dict[str, Any]:
    doc = json.loads(body)
    assert doc["type"] == "about:blank"
    return dict(doc)


def test_a_chunked_body_past_the_bound_is_cut_off_with_a_413(server: ServerThread) -> None:
    total = 4 * MAX_BODY_BYTES
    sent, status, body = exchange(server, head(server, "Transfer-Encoding: chunked\r\n"),
                                  chunked(total))
    assert status == 413
    assert problem_of(body)["detail"] == f"a request body is at most {MAX_BODY_BYTES} bytes"
    assert sent < total  # answered while the client was still sending


def test_a_declared_length_past_the_bound_is_refused_before_the_body(
    server: ServerThread
) -> None:
    extra = f"Content-Length: {MAX_BODY_BYTES + 1}\r\n"
    sent, status, body = exchange(server, head(server, extra), iter([b"x" * CHUNK] * 4))
    assert status == 413 and problem_of(body)["status"] == 413


def test_a_chunked_body_within_the_bound_is_served(server: ServerThread) -> None:
    doc = json.dumps({"model": "m", "layout": LAYOUT, "token_ids": list(range(8))}).encode()
    pieces = [doc[i : i + 16] for i in range(0, len(doc), 16)]
    chunks = iter([b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"])
    _, status, body = exchange(server, head(server, "Transfer-Encoding: chunked\r\n"), chunks)
    assert status == 200, body
    assert json.loads(body)["full_blocks"] == 2
