"""ASGI entry point of the front (Daphne): HTTP through Django, WebSockets through
Channels. Importing it never imports torch, transformers, sentence_transformers or
llama_cpp (tests/platform/test_front_imports.py proves it)."""

import os

from channels.routing import ProtocolTypeRouter
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "roundhouse.settings")

# Django must be set up before anything imports models (the WebSocket routes will).
django_application = get_asgi_application()

application = ProtocolTypeRouter({"http": django_application})
