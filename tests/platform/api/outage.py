"""A real outage of the database, which a test starts and ends: what the
`outage` fixture (conftest.py) hands the tests of the API and its selectors."""

import socket

import psycopg
from django.db import connection, connections

from api.gateway import front_gateway


class Outage:
    """A database outage of one kind, which the test starts and ends. Connections
    of the calling thread and of the gateway's loader are closed at both ends,
    so that they connect again (and fail, then succeed)."""

    def __init__(self, kind: str, tmp_path) -> None:
        self.kind = kind
        self.settings = connection.settings_dict  # shared by every thread's
        self.saved: dict[str, object] = {}
        self.tmp_path = tmp_path
        self.name = self.settings["NAME"]

    def start(self) -> None:
        if self.kind == "refusing":
            self._admin(f'ALTER DATABASE "{self.name}" ALLOW_CONNECTIONS false')
            self._admin(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                [self.name],
            )
        elif connection.vendor == "sqlite":
            self._set("NAME", str(self.tmp_path / "no-such-dir" / "db.sqlite3"))
        else:
            with socket.socket() as probe:  # a port nothing listens on
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            self._set("HOST", "127.0.0.1")
            self._set("PORT", str(port))
        self._close_connections()

    def end(self) -> None:
        if self.kind == "refusing":
            self._admin(f'ALTER DATABASE "{self.name}" ALLOW_CONNECTIONS true')
        self.settings.update(self.saved)
        self.saved.clear()
        self._close_connections()

    def _set(self, name: str, value: object) -> None:
        self.saved.setdefault(name, self.settings[name])
        self.settings[name] = value

    def _admin(self, sql: str, params: list | None = None) -> None:
        with psycopg.connect(
            host=self.settings["HOST"] or None,
            port=self.settings["PORT"] or None,
            user=self.settings["USER"] or None,
            password=self.settings["PASSWORD"] or None,
            dbname="postgres",
            autocommit=True,
        ) as admin:
            admin.execute(sql, params)

    @staticmethod
    def _close_connections() -> None:
        connections.close_all()
        front_gateway().close()
