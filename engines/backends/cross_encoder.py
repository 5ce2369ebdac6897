"""Sentence-transformers cross-encoders: rerankers that read a query and a
document together and score how relevant the document is."""

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engines.backends.embedding import DEVICE_FOR_BACKEND

Pair = tuple[str, str]


class CrossEncoderBackend:
    """One cross-encoder held in memory; `score_counted` runs one batched pass
    over (query, document) pairs."""

    def __init__(self, path: Path | str, *, backend: str, batch_size: int) -> None:
        from sentence_transformers import CrossEncoder

        device = DEVICE_FOR_BACKEND.get(backend)
        if device is None:
            raise ValueError(f"a {backend} engine cannot run rerank models")
        self.batch_size = batch_size
        self.model = CrossEncoder(str(path), device=device, local_files_only=True)

    def score_counted(self, pairs: Sequence[Pair]) -> tuple[np.ndarray, np.ndarray]:
        """Each pair's relevance score, and its token count as the model reads
        it (the pair together, truncated to the model's length)."""
        pairs = [tuple(pair) for pair in pairs]
        scores = self.model.predict(
            pairs,
            batch_size=max(self.batch_size, 1),
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(scores, dtype=np.float32).reshape(len(pairs)), self._counts(
            pairs
        )

    def _counts(self, pairs: list[Pair]) -> np.ndarray:
        tokenizer = self.model.tokenizer
        encoded = tokenizer(
            [query for query, _ in pairs],
            [document for _, document in pairs],
            truncation=True,
            max_length=self.model.max_length or tokenizer.model_max_length,
        )
        return np.array([len(ids) for ids in encoded["input_ids"]], dtype=np.int64)
