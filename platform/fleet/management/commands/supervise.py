"""`manage.py supervise`: run the engine supervisor for this host (one per host)."""

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from cluster.services import ClusterUnavailable, NodeRefused
from fleet.services import FleetStartError, fleet_ensure
from fleet.supervisor import Supervisor
from fleet.supervisor_lock import SupervisorRunning


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
