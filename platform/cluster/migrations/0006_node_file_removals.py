"""Deleting a model's files from a node (fleet/file_removals.py): the
removals the front asks of a node (`file_removals`) and what the node's
supervisor did with them (`files_removed`, written by the node). Node roles
made before it may write `files_removed` on their own row, and read the
model pulls (deleting a model's files is refused while a pull writes into its
folder), at once: without that, their supervisors would refuse every removal
until `node_db_role --grant-all` (PostgreSQL only)."""

from django.db import migrations, models


def grant_to_node_roles(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    node = apps.get_model("cluster", "Node")
    pull = apps.get_model("catalog", "ModelPull")
    roles = node.objects.exclude(db_role="").filter(revoked_at__isnull=True)
    quote = schema_editor.quote_name
    with schema_editor.connection.cursor() as cursor:
        for role in roles.values_list("db_role", flat=True):
            cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
            if cursor.fetchone() is None:
                continue
            cursor.execute(
                f"GRANT UPDATE ({quote('files_removed')}) "
                f"ON {quote(node._meta.db_table)} TO {quote(role)}"
            )
            cursor.execute(
                f"GRANT SELECT ON {quote(pull._meta.db_table)} TO {quote(role)}"
            )


class Migration(migrations.Migration):
    dependencies = [
        ("cluster", "0005_node_reaches"),
        ("catalog", "0011_model_pulls"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="file_removals",
            field=models.JSONField(
                blank=True,
                default=dict,
                editable=False,
                help_text="Models whose files the operator asked this node to delete (the admin's action Delete files from a node): each model's path as the catalog had it and when it was asked. Written by the front.",
                verbose_name="file removals asked",
            ),
        ),
        migrations.AddField(
            model_name="node",
            name="files_removed",
            field=models.JSONField(
                blank=True,
                default=dict,
                editable=False,
                help_text="What this node's supervisor did with each removal asked: the request it answers (when it was asked), the bytes freed or why it refused, and when. Written by the node.",
                verbose_name="file removals carried out",
            ),
        ),
        migrations.RunPython(grant_to_node_roles, migrations.RunPython.noop),
    ]
