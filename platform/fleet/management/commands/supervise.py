"""`manage.py supervise`: run the engine supervisor for this host (one per host)."""

import logging

from django import db
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from cluster.services import ClusterUnavailable, NodeRefused
from fleet.selectors import engine_specs_on_nodes_only
from fleet.services import FleetStartError, fleet_ensure
from fleet.supervisor import Supervisor
from fleet.supervisor_lock import SupervisorRunning

log = logging.getLogger("roundhouse.supervisor")


def plain_supervisor_notice() -> str | None:
    """What a supervisor without --node says when every enabled engine spec
    belongs to a node (it would run no engine), or None."""
    try:
        by_node = engine_specs_on_nodes_only()
    except db.Error:
        return None  # the supervisor rides out the outage and says so itself
    if not by_node:
        return None
    owned = "; ".join(f"{node}: {', '.join(specs)}" for node, specs in by_node.items())
    return (
        f"every enabled engine spec belongs to a node ({owned}): this supervisor, "
        "started without --node, runs no engine. On each node's host run "
        "`manage.py supervise --node NAME` instead (the first host too, once its "
        "specs name its node: stop this one and start that)."
    )


class Command(BaseCommand):
    help = (
        "Spawn, watch and respawn the enabled engines, writing their state to the "
        "database, until SIGINT/SIGTERM. With --ensure: start one in the background "
        "unless one runs, wait for its engines, and return."
    )
    supervisor_class = Supervisor

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--ensure",
            action="store_true",
            help="Return at once if a supervisor runs; else start one in the "
            "background and wait until its engines answer.",
        )
        parser.add_argument(
            "--timeout", type=float, default=180.0, help="--ensure: seconds to wait."
        )
        parser.add_argument(
            "--node",
            help="Run this host as the cluster node NAME: join it (the first time, "
            "with ROUNDHOUSE_JOIN_TOKEN from the admin's join command), heartbeat, "
            "run its relay, and supervise its engines only. Needs PostgreSQL.",
        )

    def handle(
        self, *args, ensure: bool, timeout: float, node: str | None, **options
    ) -> None:
        if ensure and node:
            raise CommandError("--ensure starts a one-host supervisor: no --node")
        notice = None if node else plain_supervisor_notice()
        if notice is not None:
            log.warning("%s", notice)
            self.stdout.write(self.style.WARNING(notice))
        if ensure:
            try:
                outcome = fleet_ensure(timeout_s=timeout)
            except FleetStartError as error:
                raise CommandError(str(error)) from error
            self.stdout.write(f"supervisor {outcome}")
            return
        supervisor = self.supervisor_class(run_dir=settings.RUN_DIR, node=node)
        try:
            supervisor.startup()
        except (
            SupervisorRunning,
            ClusterUnavailable,
            ImproperlyConfigured,  # a private CA only half given
            OSError,
        ) as error:
            raise CommandError(str(error)) from error
        except NodeRefused as refused:
            raise CommandError(refused.message) from refused
        try:
            supervisor.run()
        finally:
            supervisor.shutdown()
        if supervisor.exit_code is not None:  # a loop thread stopped
            raise SystemExit(supervisor.exit_code)
