"""Per-model GPU settings: GGUF layers on the cards and their split, a transformers model's precision and its share of each card."""

import django.core.validators
from django.db import migrations, models

import catalog.models


class Migration(migrations.Migration):
    dependencies = [
        ("catalog", "0012_pull_progress_at_and_node_reason"),
    ]

    operations = [
        migrations.AddField(
            model_name="modelconfig",
            name="dtype",
            field=models.CharField(
                choices=[
                    ("auto", "Its own (bfloat16/float16 on a GPU, float32 on the CPU)"),
                    ("float32", "float32"),
                    ("bfloat16", "bfloat16"),
                    ("float16", "float16"),
                ],
                default="auto",
                help_text="Transformers models: the precision the weights load in.",
                max_length=16,
                verbose_name="precision",
            ),
        ),
        migrations.AddField(
            model_name="modelconfig",
            name="gpu_layers",
            field=models.CharField(
                default="auto",
                help_text="GGUF on a GPU engine: auto (as many layers as its cards' free memory holds, the rest on the CPU), all, none, or a number of layers.",
                max_length=8,
                validators=[catalog.models.validate_gpu_layers],
                verbose_name="GPU layers",
            ),
        ),
        migrations.AddField(
            model_name="modelconfig",
            name="max_gpu_percent",
            field=models.PositiveSmallIntegerField(
                default=90,
                help_text="Transformers models: the share of each card's memory the model may take; what does not fit is offloaded to the CPU.",
                validators=[
                    django.core.validators.MinValueValidator(1),
                    django.core.validators.MaxValueValidator(100),
                ],
                verbose_name="max GPU %",
            ),
        ),
        migrations.AddField(
            model_name="modelconfig",
            name="tensor_split",
            field=models.CharField(
                blank=True,
                help_text="GGUF on an engine with several cards: each card's share of the layers, in the engine's card order, e.g. 3,1. Empty: by their free memory.",
                max_length=100,
                validators=[catalog.models.validate_tensor_split],
            ),
        ),
    ]
