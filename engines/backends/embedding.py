"""Sentence-transformers embedders (e.g. the bundled all-MiniLM-L6-v2)."""

from pathlib import Path

import numpy as np

DEVICE_FOR_BACKEND = {"cpu": "cpu", "cuda": "cuda", "rocm": "cuda"}


class EmbeddingBackend:
    """One embedding model held in memory; encode() runs one batched pass."""

    def __init__(self, path: Path | str, *, backend: str, batch_size: int) -> None:
        from sentence_transformers import SentenceTransformer

        device = DEVICE_FOR_BACKEND.get(backend)
        if device is None:
            raise ValueError(f"a {backend} engine cannot run embedding models")
        self.batch_size = batch_size
        self.model = SentenceTransformer(
            str(path), device=device, local_files_only=True
        )
        self.dimensions = self.model.get_embedding_dimension()

    def encode_counted(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Rows plus each text's token count (as the model sees it, truncated)."""
        return self.encode(texts), self.count_tokens(texts)

    def count_tokens(self, texts: list[str]) -> np.ndarray:
        encoded = self.model.tokenizer(
            texts, truncation=True, max_length=self.model.max_seq_length
        )
        return np.array([len(ids) for ids in encoded["input_ids"]], dtype=np.int64)

    def encode(self, texts: list[str]) -> np.ndarray:
        rows = self.model.encode(
            texts,
            batch_size=max(self.batch_size, 1),
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(rows, dtype=np.float32)
