"""Routes of tokenize, detokenize (at the root, as vLLM and llama.cpp's server
mount them, and under /v1/) and rerank (/v1/rerank, /v2/rerank); mounted at
the root, before /v1/'s catch-all (roundhouse.urls)."""

from django.urls import path

from . import rerank, tokenize

urlpatterns = [
    path("tokenize", tokenize.tokenize),
    path("detokenize", tokenize.detokenize),
    path("v1/tokenize", tokenize.tokenize),
    path("v1/detokenize", tokenize.detokenize),
    path("v1/rerank", rerank.rerank_v1),
    path("v2/rerank", rerank.rerank_v2),
]
