"""Ollama's API (`/api/...`) as a dialect at the edge of the one pipeline:
protocol.py (the typed bodies), serving.py (each body translated into the
OpenAI-shaped request the pipeline serves, and the answer back into Ollama's
JSON or NDJSON), listing.py (/api/tags, /api/show, /api/ps from the catalog
and the fleet), pulling.py (/api/pull onto the pulls of api.pulls), access.py
(the key, or the loopback key for tools that cannot send one), views.py and
urls.py (the routes, mounted at /api/ by roundhouse.urls)."""
