from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("api", "0005_usage_node"),
    ]

    operations = [
        migrations.AddField(
            model_name="apikey",
            name="manages_models",
            field=models.BooleanField(
                default=False,
                help_text="May pull and delete models (the /v1/pulls and DELETE "
                "/v1/models endpoints).",
            ),
        ),
    ]
