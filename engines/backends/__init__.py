"""Model backends run inside an engine process (they import the ML libraries).
factory.load_backend builds one with its slot plan (memory, which estimates a
model's memory from its files, GGUF headers read by ggufmeta, without an ML
library); llama.init_llama_cpp sets llama.cpp up once."""
