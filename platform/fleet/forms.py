"""Admin form fields for fleet data."""

from django import forms
from django.core.exceptions import ValidationError
from django.utils.html import format_html, format_html_join

from routing import compat

from .models import EngineSpec


class EnvBlockField(forms.CharField):
    """An env block edited as KEY=VALUE lines; `KEY=` sets the variable empty."""

    widget = forms.Textarea(attrs={"rows": 5, "cols": 60, "spellcheck": "false"})

    def prepare_value(self, value):
        if isinstance(value, dict):
            return "\n".join(f"{key}={item}" for key, item in value.items())
        return value

    def to_python(self, value) -> dict[str, str]:
        if isinstance(value, dict):
            return value
        block: dict[str, str] = {}
        for number, raw in enumerate((value or "").splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, item = line.partition("=")
            if not sep:
                raise ValidationError(
                    f"Line {number}: expected KEY=VALUE (KEY= for an empty value)."
                )
            key = key.strip()
            if key in block:
                raise ValidationError(f"Line {number}: {key} is set twice.")
            block[key] = item
        return block


class EngineNameInput(forms.TextInput):
    """A text input suggesting the configured engine names (a pin may name an
    engine that does not exist yet; that is warned about, not refused)."""

    def render(self, name, value, attrs=None, renderer=None):
        list_id = f"{(attrs or {}).get('id', name)}_engines"
        names = EngineSpec.objects.order_by("order", "name").values_list(
            "name", flat=True
        )
        field = super().render(
            name, value, {**(attrs or {}), "list": list_id}, renderer
        )
        options = format_html_join("", '<option value="{}">', ((n,) for n in names))
        return format_html('{}<datalist id="{}">{}</datalist>', field, list_id, options)


class EngineSpecForm(forms.ModelForm):
    env = EnvBlockField(
        required=False,
        help_text="One KEY=VALUE per line, applied over the supervisor's "
        "environment; KEY= sets it empty (e.g. CUDA_VISIBLE_DEVICES=).",
    )
    capabilities = forms.MultipleChoiceField(
        choices=[(fmt, fmt) for fmt in compat.FORMATS],
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="None checked: the backend's defaults.",
    )
