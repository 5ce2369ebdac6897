"""The front never imports an ML library: the web process stays light and its
event loop never blocks on a model."""

import json

from tests.conftest import run_python

HEAVY = ["torch", "transformers", "sentence_transformers", "llama_cpp"]

PROBE = """
import json, os, sys
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "roundhouse.settings")
import roundhouse.serve  # the front's server, as the Procfile starts it
import roundhouse.asgi  # the real ASGI application it serves
from django.urls import get_resolver
get_resolver().url_patterns  # import every view module as a first request would
from django.contrib import admin
for model_admin in admin.site._registry.values():
    model_admin.get_urls()
APPS = ("fleet", "catalog", "api", "chat", "batches")
print(json.dumps({"loaded": sorted(m for m in HEAVY if m in sys.modules),
                  "apps": sorted(m for m in APPS if m in sys.modules)}))
"""


def test_asgi_application_imports_no_ml_library():
    """Importing the ASGI app and its URLs leaves torch & co. out of sys.modules."""
    result = run_python(f"HEAVY = {HEAVY!r}\n{PROBE}")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["apps"] == ["api", "batches", "catalog", "chat", "fleet"]
    assert report["loaded"] == []


def test_probe_detects_an_ml_import():
    """The probe itself sees a heavy import (so the test above can fail)."""
    result = run_python(f"HEAVY = {HEAVY!r}\nimport llama_cpp\n{PROBE}")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["loaded"] == ["llama_cpp"]
