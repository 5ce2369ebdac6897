import django.core.validators
from django.db import migrations, models


def take_new_default(apps, schema_editor):
    """Settings still at the old KV budget (1,024 MiB) take the new one (1,536
    MiB: the bundled SmolLM2's 32 auto slots each hold their whole 2,048-token
    context, a KV stream each, docs/internals/batching.md); a value an
    operator chose stays."""
    ConcurrencySettings = apps.get_model("fleet", "ConcurrencySettings")
    ConcurrencySettings.objects.filter(kv_cache_mib=1024).update(kv_cache_mib=1536)


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0009_engine_state_row_security"),
    ]

    operations = [
        migrations.AlterField(
            model_name="concurrencysettings",
            name="kv_cache_mib",
            field=models.PositiveIntegerField(
                default=1536,
                help_text="Memory for one generation model's KV cache, a pool its slots share (a long conversation may use more than its share). Auto slots: one per 1,024 tokens it holds, up to the slot cap.",
                validators=[django.core.validators.MinValueValidator(16)],
                verbose_name="KV cache (MiB)",
            ),
        ),
        migrations.RunPython(take_new_default, migrations.RunPython.noop),
    ]
