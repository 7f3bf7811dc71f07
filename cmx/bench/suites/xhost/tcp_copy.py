"""The plainest copy of bytes between two hosts: one TCP stream, Python's socket calls.

A sender runs on the host that holds the bytes (``python -m cmx.bench.suites.xhost.tcp_copy
ADDRESS``, started inside that host's network namespace): it listens on ADDRESS, prints its
port, and for each connection reads an 8-byte big-endian count and sends that many bytes with
``sendall`` of a 64 MiB buffer. The receiver (``TcpSource.copy``) asks for the bytes and reads
them with ``recv_into`` straight into a buffer whose pages are already faulted in, so what is
timed is the network path alone: the request, the bytes on the wire, the kernel's copies.
Socket buffers are left to the kernel's autotuning (a fixed SO_RCVBUF turns it off and is
capped by ``net.core.rmem_max``).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["CHUNK", "TcpSource", "serve"]

CHUNK = 64 << 20  # bytes per sendall / recv_into call
COUNT = 8  # bytes of the request: how many bytes to send, big-endian
TIMEOUT_S = 120.0  # bound on connecting and on each recv, on a busy machine


def serve(address: str) -> None:
    """Listen on ``address``, print the port, answer every request until killed."""
    payload = memoryview(bytes(range(256)) * (CHUNK // 256))
    with socket.create_server((address, 0)) as server:
        print(server.getsockname()[1], flush=True)
        while True:
            conn, _ = server.accept()
            with conn:
                nbytes = int.from_bytes(_recv_exact(conn, COUNT), "big")
                while nbytes > 0:
                    n = min(nbytes, CHUNK)
                    conn.sendall(payload[:n])
                    nbytes -= n


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        got = conn.recv(n - len(data))
        if not got:
            raise ConnectionError(f"peer closed after {len(data)} of {n} bytes")
        data += got
    return data


class TcpSource:
    """A sender started on another host (``prefix`` runs a command there), and copies of its
    bytes into this process."""

    def __init__(self, prefix: Sequence[str], address: str) -> None:
        self.address = address
        self.process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "cmx.bench.suites.xhost.tcp_copy", address],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.port = self._port()

    def _port(self) -> int:
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if not line.isdigit():
            self.close()
            err = self.process.stderr.read() if self.process.stderr else ""
            raise RuntimeError(f"the TCP sender did not start: {line!r} {err[-1500:]}")
        return int(line)

    def copy(self, into: memoryview) -> float:
        """Seconds to receive ``len(into)`` bytes from the sender: from the request sent to
        the last byte in ``into`` (the connection is made before the clock starts)."""
        nbytes = len(into)
        with socket.create_connection((self.address, self.port), timeout=TIMEOUT_S) as conn:
            t0 = time.perf_counter()
            conn.sendall(nbytes.to_bytes(COUNT, "big"))
            got = 0
            while got < nbytes:
                n = conn.recv_into(into[got: got + CHUNK])
                if n == 0:
                    raise ConnectionError(f"the sender closed after {got} of {nbytes} bytes")
                got += n
            return time.perf_counter() - t0

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


if __name__ == "__main__":
    serve(sys.argv[1])
