"""Writes of catalog data."""

from django.utils import timezone

from .models import ModelConfig

# A new measurement replaces the stored one only when it moved this much: the
# stored figure feeds the engines' configuration, which should not churn.
MEASUREMENT_TOLERANCE = 0.1


def model_memory_record(*, name: str, memory_mib: float) -> bool:
    """Store the memory a load measured for a model; True when it changed."""
    model = ModelConfig.objects.filter(name=name).first()
    if model is None or memory_mib <= 0:
        return False
    old = model.measured_memory_mib
    if old and abs(memory_mib - old) <= old * MEASUREMENT_TOLERANCE:
        return False
    model.measured_memory_mib = round(memory_mib)
    model.measured_at = timezone.now()
    model.save(update_fields=["measured_memory_mib", "measured_at"])
    return True
