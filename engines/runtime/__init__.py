"""The engine process: its entry point, server, request streaming, residency,
memory, devices, thermal gate, watcher and micro-batcher."""
