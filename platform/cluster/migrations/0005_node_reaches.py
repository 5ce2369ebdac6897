"""The heartbeat's `reaches` (how long a node's links to each peer have
failed). Node roles made before it may update it at once: without that,
their supervisors' heartbeats would fail from the upgrade until
`node_db_role --grant-all` (PostgreSQL only)."""

from django.db import migrations, models


def grant_to_node_roles(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    node = apps.get_model("cluster", "Node")
    roles = node.objects.exclude(db_role="").filter(revoked_at__isnull=True)
    quote = schema_editor.quote_name
    with schema_editor.connection.cursor() as cursor:
        for role in roles.values_list("db_role", flat=True):
            cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
            if cursor.fetchone() is not None:
                cursor.execute(
                    f"GRANT UPDATE ({quote('reaches')}) "
                    f"ON {quote(node._meta.db_table)} TO {quote(role)}"
                )


class Migration(migrations.Migration):
    dependencies = [
        ("cluster", "0004_node_loop_errors"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="reaches",
            field=models.JSONField(
                blank=True,
                default=dict,
                editable=False,
                help_text="For each other node this node's supervisor tried to link to at its last heartbeat: for how many seconds its links have failed (0: linked). A node that every other node fails to link to for 6 s is unreachable, whatever its heartbeat.",
                verbose_name="links to peers",
            ),
        ),
        migrations.RunPython(grant_to_node_roles, migrations.RunPython.noop),
    ]
