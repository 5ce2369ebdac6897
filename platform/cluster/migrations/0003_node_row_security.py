"""A node's own database role (fleet/node_database.py): the node table gets a
`db_role` column and row-level security, with one permissive policy for every
role, so nothing changes for any connection until a node role is made (its
restrictive policies are its own). FORCE is not set: the tables' owner (the
front's connection) bypasses row security as before. Nothing on SQLite."""

from django.db import migrations, models

TABLE = "cluster_node"
POLICY = "roundhouse_every_row"


def row_security_on(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"ALTER TABLE {TABLE} ENABLE ROW LEVEL SECURITY")
    schema_editor.execute(
        f"CREATE POLICY {POLICY} ON {TABLE} AS PERMISSIVE FOR ALL TO PUBLIC "
        "USING (true) WITH CHECK (true)"
    )


def row_security_off(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"DROP POLICY IF EXISTS {POLICY} ON {TABLE}")
    schema_editor.execute(f"ALTER TABLE {TABLE} DISABLE ROW LEVEL SECURITY")


class Migration(migrations.Migration):
    dependencies = [
        ("cluster", "0002_node_copies"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="db_role",
            field=models.CharField(
                blank=True,
                editable=False,
                help_text="The PostgreSQL role this node's supervisor logs in as (`manage.py node_db_role`): it may write this node's own rows only. Empty: the node uses the full DATABASE_URL.",
                max_length=63,
                verbose_name="database role",
            ),
        ),
        migrations.AddConstraint(
            model_name="node",
            constraint=models.UniqueConstraint(
                condition=models.Q(("db_role", ""), _negated=True),
                fields=("db_role",),
                name="cluster_node_db_role_unique",
            ),
        ),
        migrations.RunPython(row_security_on, row_security_off),
    ]
