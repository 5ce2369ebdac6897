"""Seed one cpu engine (the primary), the settings rows and the bundled models.

The values are written out here, not imported from app code, so this migration
keeps meaning the same thing as the code changes.
"""

from django.db import migrations

BUNDLED = [
    {
        "name": "smollm2-135m-instruct",
        "format": "gguf",
        "task": "chat",
        "path": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "context_length": 2048,
        "sampling": {"temperature": 0.7, "top_p": 0.95, "max_tokens": 256},
    },
    {
        "name": "gemma3-270m",
        "format": "gguf",
        "task": "completion",
        "path": "gemma-3-270m-q4_k_m.gguf",
        "context_length": 2048,
        "sampling": {"temperature": 0.8, "top_p": 0.95, "max_tokens": 128},
    },
    {
        "name": "all-minilm-l6-v2",
        "format": "embedding",
        "task": "embedding",
        "path": "all-MiniLM-L6-v2",
        "context_length": None,
        "sampling": {},
    },
]


def seed(apps, schema_editor):
    EngineSpec = apps.get_model("fleet", "EngineSpec")
    ServerSettings = apps.get_model("fleet", "ServerSettings")
    ThermalSettings = apps.get_model("fleet", "ThermalSettings")
    ConcurrencySettings = apps.get_model("fleet", "ConcurrencySettings")
    ModelConfig = apps.get_model("catalog", "ModelConfig")

    cpu0, _ = EngineSpec.objects.get_or_create(
        name="cpu0", defaults={"backend": "cpu", "order": 0, "enabled": True}
    )
    ServerSettings.objects.get_or_create(pk=1, defaults={"default_engine": cpu0})
    ThermalSettings.objects.get_or_create(pk=1)
    ConcurrencySettings.objects.get_or_create(pk=1)
    for row in BUNDLED:
        ModelConfig.objects.get_or_create(name=row["name"], defaults=row)


def unseed(apps, schema_editor):
    ModelConfig = apps.get_model("catalog", "ModelConfig")
    ModelConfig.objects.filter(name__in=[row["name"] for row in BUNDLED]).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("catalog", "0001_initial"),
        ("fleet", "0001_initial"),
    ]

    operations = [migrations.RunPython(seed, unseed)]
