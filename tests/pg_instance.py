"""A PostgreSQL server of the test's own (initdb into a temporary directory, its own port), so
that a test can stall it (SIGSTOP/SIGCONT), stop it and start it again without touching the
shared server; and a gateway on one, with the short database bounds the outage tests use."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from tests.api_harness import LiveGateway, gateway_settings, live_gateway

PG_BIN = Path("/usr/lib/postgresql/15/bin")


def _as_owner(command: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: there, run it as the ``postgres`` user."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *command]
    return command


class PgInstance:
    def __init__(self, port: int) -> None:
        root = Path(tempfile.mkdtemp(prefix=f"specgate-pg{port}-"))
        if os.geteuid() == 0:
            os.chown(root, pwd.getpwnam("postgres").pw_uid, -1)
        self.root = root
        self.data = root / "pgdata"
        self.socket_dir = root / "pgsock"
        self.port = port
        self.log = root / "postgres.log"

    @property
    def server_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}"

    def init(self) -> None:
        subprocess.run(_as_owner(["mkdir", "-p", str(self.socket_dir)]), check=True)
        subprocess.run(
            _as_owner(
                [str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust"]
            ),
            check=True,
            capture_output=True,
        )

    def start(self) -> None:
        options = f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run(
            _as_owner([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log),
                       "-o", options, "-w", "start"]),
            check=True,
            capture_output=True,
        )  # fmt: skip

    def stop(self) -> None:
        subprocess.run(
            _as_owner(
                [str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"]
            ),
            check=False,
            capture_output=True,
        )

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def create_database(self, name: str) -> str:
        with psycopg.connect(f"{self.server_url}/postgres", autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        return f"{self.server_url}/{name}"

    def _pids(self) -> list[int]:
        """The postmaster and its children (backends, background workers)."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        pids = [postmaster]
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
                    pids.append(int(entry.name))
        return pids

    def _signal(self, signum: signal.Signals) -> None:
        """``signum`` to the postmaster and its children; a backend that exited after it was
        listed is no longer there to signal (a connection closing as a test tears down)."""
        for pid in self._pids():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                continue

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        time.sleep(0.1)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def running_instance() -> Iterator[PgInstance]:
    """A started instance on a free port; resumed (if stalled), stopped and removed after."""
    instance = PgInstance(free_port())
    instance.init()
    instance.start()
    try:
        yield instance
    finally:
        instance.resume()
        instance.stop()
        instance.remove()


# The outage tests' bounds: a database call gives up after AUDIT_TIMEOUT_S, the spool retries
# every 0.2 s.
AUDIT_TIMEOUT_S = 2.0


@contextmanager
def gateway_on(
    instance: PgInstance,
    models: tuple[Path, Path],
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    **extra: object,
) -> Iterator[LiveGateway]:
    """A live gateway on a fresh database ``name`` of ``instance`` (settings: the outage
    bounds, then ``extra``)."""
    settings = gateway_settings(
        models,
        tmp_path_factory.mktemp(f"{name}-data"),
        instance.create_database(name),
        **{
            "audit_timeout_s": AUDIT_TIMEOUT_S,
            "db_connect_timeout_s": 2.0,
            "db_statement_timeout_s": 2.0,
            "spool_retry_s": 0.2,
            **extra,
        },
    )
    with live_gateway(settings, name) as live:
        yield live
