"""Engine processes, grouped by concern. No Django anywhere here.

- wire: what crosses a process boundary (framing, errors, bounds, typed
  requests and frames) and the clients. The only part the web side imports.
- launch: what an engine is told at spawn (config) and how it is started.
- runtime: the engine process (serve, server, streaming, residency, memory,
  devices, thermal, watcher, batching).
- generation: continuous batching (runner, slots, prefix sharing, context,
  prompts, sampling, chat templates).
- constrained: grammars (JSON, schemas) and tool calls.
- backends: llama.cpp, transformers and sentence-transformers models, and the
  factory that builds one.
- inspection: one-shot child processes of the catalog (probe, quantize,
  evaluate) and their messages.

Keep these package files free of imports: the web process imports engines.wire,
and must never pull an ML library in through a package.
"""
