"""The test launcher itself: a port taken between its pick and the server's bind, and a
restart at the same address."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.servers import HOST, ServerProcess, _tempdir, server_process


@contextmanager
def held_port(port: int = 0) -> Iterator[int]:
    """A port (``port``, else any) another process (this one) listens on and never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (past a TIME_WAIT)
        sock.bind((HOST, port))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize("which", ["port", "bus_port"])
def test_a_first_start_moves_off_a_port_taken_before_the_bind(which: str) -> None:
    with held_port() as taken, _tempdir(f"taken-{which}") as directory:
        node = ["--cluster-enabled", "yes", "--cluster-config-file", str(directory / "nodes.conf")]
        server = ServerProcess(node if which == "bus_port" else [], directory, **{which: taken})
        try:
            server.start()
            assert getattr(server, which) != taken
            with server.client() as client:
                assert client.ping()
        finally:
            server.kill()


def test_a_port_another_server_answers_on_is_not_taken_for_ours() -> None:
    # The likeliest thief of a port is another test's server: its answers are not ours.
    with server_process(tag="other") as other, _tempdir("ours") as directory:
        ours = ServerProcess([], directory, port=other.port)
        try:
            ours.start()
            assert ours.port != other.port
            with ours.client() as client:
                assert ours.process is not None
                assert int(client.info("server")["process_id"]) == ours.process.pid
        finally:
            ours.kill()


def test_a_restart_keeps_its_port_and_fails_if_it_is_taken() -> None:
    # Clients know the address of a server that answered once: it never moves.
    with _tempdir("restart") as directory:
        server = ServerProcess([], directory)
        try:
            server.start()
            port = server.port
            server.kill()
            with held_port(port), pytest.raises(RuntimeError, match="exited"):
                server.start()
            assert server.port == port
            server.start()
            assert server.port == port
        finally:
            server.kill()
