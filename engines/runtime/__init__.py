"""The engine process: its entry point, server, request streaming, residency,
thermal gate, watcher and micro-batcher."""
