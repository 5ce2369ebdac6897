"""Model backends run inside an engine process (they import the ML libraries).
factory.load_backend builds one; llama.init_llama_cpp sets llama.cpp up once."""
