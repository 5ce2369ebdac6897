"""`manage.py node_db_role NAME`: give a node its own database role, so that
its host (one that runs only a supervisor) can write nothing but its own rows.
Run by the operator where the full DATABASE_URL is (a front's host)."""

from django.core.management.base import BaseCommand, CommandError

from cluster.models import Node
from fleet.node_database import (
    NodeRoleError,
    node_role_create,
    node_role_drop,
    node_role_grant_all,
)


class Command(BaseCommand):
    help = (
        "Make (or give a new password to) node NAME's own PostgreSQL role and print "
        "the DATABASE_URL its supervisor runs with, once; --drop removes the role; "
        "--grant-all grants every node role what this version's supervisor needs."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("node", nargs="?", help="The node's name (admin).")
        parser.add_argument(
            "--role",
            default="",
            help="The role's name (default: rh_<database>_<node>). Roles are "
            "shared by every database of the server: the name must be free.",
        )
        parser.add_argument(
            "--drop", action="store_true", help="Drop the node's role instead."
        )
        parser.add_argument(
            "--grant-all",
            action="store_true",
            help="Grant every node's role again (after an upgrade); no passwords.",
        )

    def handle(
        self, *args, node: str | None, role: str, drop: bool, grant_all: bool, **options
    ) -> None:
        if grant_all:
            if node or drop:
                raise CommandError("--grant-all takes no node and no --drop")
            try:
                roles = node_role_grant_all()
            except NodeRoleError as error:
                raise CommandError(str(error)) from error
            self.stderr.write(f"granted: {', '.join(roles) or 'no node roles'}")
            return
        if not node:
            raise CommandError("name the node (or --grant-all)")
        row = Node.objects.filter(name=node).first()
        if row is None:
            raise CommandError(f"no node named {node!r}: add it in the admin first")
        try:
            if drop:
                self.stderr.write(f"dropped role {node_role_drop(node=row)}")
                return
            credentials = node_role_create(node=row, role=role)
        except NodeRoleError as error:
            raise CommandError(str(error)) from error
        self.stderr.write(
            f"node {row.name} logs in as role {credentials.role}. Its supervisor "
            "runs with this DATABASE_URL (shown once; a new run of this command "
            "gives a new password):"
        )
        # The one line on stdout, so that it can go straight into a 0600 file.
        self.stdout.write(f"DATABASE_URL={credentials.database_url()}")
