"""Writes of catalog data."""

from django.utils import timezone

from .models import ModelConfig

# A new measurement replaces the stored one only when it moved this much: the
# stored figure feeds the engines' configuration, which should not churn.
MEASUREMENT_TOLERANCE = 0.1


def model_memory_record(
    *, name: str, memory_mib: float, device_memory_mib: float = 0.0
) -> bool:
    """Store the memory a load measured for a model (host RAM, and GPU memory
    on a GPU engine); True when either changed."""
    model = ModelConfig.objects.filter(name=name).first()
    if model is None:
        return False
    changed = []
    for field, value in (
        ("measured_memory_mib", memory_mib),
        ("measured_device_memory_mib", device_memory_mib),
    ):
        old = getattr(model, field)
        if value <= 0 or (old and abs(value - old) <= old * MEASUREMENT_TOLERANCE):
            continue
        setattr(model, field, round(value))
        changed.append(field)
    if not changed:
        return False
    model.measured_at = timezone.now()
    model.save(update_fields=[*changed, "measured_at"])
    return True
