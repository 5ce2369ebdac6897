"""Engine processes, grouped by concern. No Django anywhere here.

- wire: what crosses a process boundary (framing, errors, bounds, typed
  requests and frames) and the clients.
- launch: what an engine is told at spawn and by `configure` (config, with
  every environment variable engines read), how it is started, its devices.
- runtime: the engine process (serve, server, streaming, residency, thermal,
  watcher, batching).
- generation: continuous batching (runner, slots, prefix sharing, context,
  prompts, sampling, chat templates).
- constrained: grammars (JSON, schemas) and tool calls.
- backends: llama.cpp, transformers and sentence-transformers models, the
  factory that builds one, and the memory estimates and slot plans it uses.
- inspection: one-shot child processes of the catalog (probe, quantize,
  evaluate) and their messages.

Each package imports only those below it: runtime and inspection, then
backends, generation, constrained, wire, launch (pyproject.toml's
import-linter contracts). The web side imports engines.wire, engines.launch and
engines.inspection.messages only. Keep these package files free of imports:
the web process must never pull an ML library in through a package.
"""
