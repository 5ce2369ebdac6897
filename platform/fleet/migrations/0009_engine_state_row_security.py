"""Row-level security on the engines' states (fleet/node_database.py): one
permissive policy for every role, so nothing changes for any connection until
a node role is made (its restrictive policies keep it to its own engines).
FORCE is not set: the tables' owner (the front's connection) bypasses row
security as before. Nothing on SQLite."""

from django.db import migrations

TABLE = "fleet_enginestate"
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
        ("fleet", "0008_enginespec_node"),
        ("cluster", "0003_node_row_security"),
    ]

    operations = [
        migrations.RunPython(row_security_on, row_security_off),
    ]
