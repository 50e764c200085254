"""A throwaway PostgreSQL server, run for real from Debian's `postgresql` package, as the backend store of the
tests' MLflow servers (the cluster's MLflow keeps its runs and registry in Postgres).

Postgres refuses to run as root: as root (CI, the dev machines) the cluster belongs to the `postgres` user the
package creates, and lives in a folder of its own under the system temp dir (pytest's are root's alone, mode 0700).
It listens on 127.0.0.1 only and trusts local connections: no password exists to leak.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg

from components.launch.process import STOP_GRACE_S, free_ports, running_process

SERVER_BINARIES = "/usr/lib/postgresql/*/bin"  # where Debian's postgresql-NN packages put initdb and postgres
SUPERUSER = "postgres"


class PostgresMissing(RuntimeError):
    """No PostgreSQL server binaries on this machine."""


def server_binaries() -> Path:
    """The folder holding ``initdb`` and ``postgres`` of the newest installed PostgreSQL server (Debian's, else
    whichever ``initdb`` is on PATH)."""
    debian = [Path(p) for p in glob.glob(SERVER_BINARIES) if (Path(p) / "postgres").is_file()]
    if debian:
        return max(debian, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else -1)
    on_path = shutil.which("initdb")
    if on_path and (Path(on_path).resolve().parent / "postgres").is_file():
        return Path(on_path).resolve().parent
    raise PostgresMissing(f"no PostgreSQL server found ({SERVER_BINARIES}/postgres, or initdb on PATH); the "
                          "tests run MLflow on Postgres as the cluster does: install it with "
                          "`bash scripts/install-debian.sh` (as root, or with sudo)")


def _as_owner(args: list[str]) -> list[str]:
    """``args`` run as the `postgres` user when this process is root (Postgres will not run as root). setpriv
    execs the command in its own place (runuser would fork and wait): the process started is the postmaster
    itself, so stopping it waits for its shutdown and a crashed one is reaped."""
    if os.geteuid() != 0:
        return args
    return ["setpriv", f"--reuid={SUPERUSER}", f"--regid={SUPERUSER}", "--init-groups", "--", *args]


@contextlib.contextmanager
def postgres_cluster() -> Iterator[Path]:
    """A fresh, initialised database cluster's data folder; removed afterwards."""
    binaries = server_binaries()
    home = Path(tempfile.mkdtemp(prefix="flowgrpo-pg-"))
    try:
        if os.geteuid() == 0:
            shutil.chown(home, SUPERUSER, SUPERUSER)
        data = home / "data"
        # --no-sync: a cluster that lives for one test session needs no durability against a power cut
        done = subprocess.run(_as_owner([str(binaries / "initdb"), "-D", str(data), "-U", SUPERUSER, "--auth=trust",
                                         "--encoding=UTF8", "--locale=C.UTF-8", "--no-sync"]),
                              capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"initdb of {data} failed ({done.returncode}): {done.stderr.strip()}")
        yield data
    finally:
        shutil.rmtree(home, ignore_errors=True)


@dataclass(frozen=True)
class PostgresServer:
    """A running server: its port on 127.0.0.1 and its data folder (whose postmaster.pid names the process to
    crash on purpose)."""

    port: int
    data: Path

    def connect(self, database: str = "postgres") -> psycopg.Connection:
        return psycopg.connect(host="127.0.0.1", port=self.port, user=SUPERUSER, dbname=database, connect_timeout=5)

    def new_database(self) -> str:
        """Create an empty database; its SQLAlchemy URI (what ``mlflow server --backend-store-uri`` takes)."""
        name = f"mlflow_{uuid.uuid4().hex[:12]}"
        with self.connect() as conn:
            conn.autocommit = True  # CREATE DATABASE cannot run inside a transaction
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{name}"

    def postmaster_pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().splitlines()[0])

    def crash(self) -> None:
        """SIGKILL the postmaster, as a node failure or the OOM killer would; its backends exit on their own."""
        os.kill(self.postmaster_pid(), signal.SIGKILL)


def _accepts_connections(server: PostgresServer) -> bool:
    try:
        server.connect().close()
    except psycopg.OperationalError:  # refused, or "the database system is starting up"
        return False
    return True


@contextlib.contextmanager
def running_postgres(data: Path, port: int | None = None, timeout_s: float = 60) -> Iterator[PostgresServer]:
    """Run the cluster in ``data`` on 127.0.0.1:``port`` (a free one by default; pass the same one to restart a
    crashed server where its clients still point), wait until it accepts connections, yield it, then stop it."""
    port = port or free_ports(1)[0]
    server = PostgresServer(port=port, data=data)
    args = _as_owner([str(server_binaries() / "postgres"), "-D", str(data), "-p", str(port),
                      "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={data}"])
    with running_process(args, cwd=data.parent, env=dict(os.environ), log_path=data.parent / f"postgres-{port}.log",
                         what="postgres", ready=lambda: _accepts_connections(server), timeout_s=timeout_s,
                         port=port) as postmaster:
        try:
            yield server
        finally:
            # a fast shutdown, which disconnects the clients still connected: the SIGTERM running_process sends is a
            # smart one, which waits for them (each backend is a session of its own, out of the signalled group)
            postmaster.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                postmaster.wait(timeout=STOP_GRACE_S)
