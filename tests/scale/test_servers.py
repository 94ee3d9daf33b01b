"""The test launcher itself: a port taken between its pick and the server's bind."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

from tests.servers import HOST, ServerProcess, _tempdir


@contextmanager
def held_port() -> Iterator[int]:
    """A port another process (this one) listens on, as a neighbour's server would."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_first_start_moves_off_a_port_taken_before_the_bind():
    with held_port() as taken, _tempdir("taken") as directory:
        server = ServerProcess([], directory, port=taken)
        try:
            server.start()
            assert server.port != taken
            with server.client() as client:
                assert client.ping()
        finally:
            server.kill()


def test_a_cluster_node_moves_off_a_bus_port_taken_before_the_bind():
    with held_port() as taken, _tempdir("taken-bus") as directory:
        node = ServerProcess(
            ["--cluster-enabled", "yes", "--cluster-config-file", str(directory / "nodes.conf")],
            directory,
            bus_port=taken,
        )
        try:
            node.start()
            assert node.bus_port != taken
            with node.client() as client:
                assert client.ping()
        finally:
            node.kill()


def test_a_restart_keeps_its_port():
    with _tempdir("restart") as directory:
        server = ServerProcess([], directory)
        try:
            server.start()
            port = server.port
            server.kill()
            server.start()
            assert server.port == port
        finally:
            server.kill()
