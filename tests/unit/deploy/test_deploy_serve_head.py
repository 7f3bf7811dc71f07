"""The local Ray head ``cmx serve`` starts: its fixed ports are moved where another head holds
them, as ``cmx up``'s are, so two heads on one machine never share Ray's client server."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator

import pytest

from cmx.deploy.launch import head_options
from cmx.operate.local_ray import HeadOptions, port_open


@pytest.fixture()
def client_port_taken() -> Iterator[int]:
    """Ray's default client-server port, held as another head holds it (or held already)."""
    port = HeadOptions().client_port
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
        assert port_open("127.0.0.1", port)
        yield port


def test_serve_moves_its_head_off_a_taken_client_port(client_port_taken: int) -> None:
    head = head_options(6390)
    assert head.client_port != client_port_taken
    assert not port_open("127.0.0.1", head.client_port)
    command = head.command()
    assert command[command.index("--ray-client-server-port") + 1] == str(head.client_port)
    assert command[command.index("--port") + 1] == "6390"
    assert "--include-dashboard=false" in command
