"""Worker extensions for tests/test_collective_rpc.py (``worker_extension_cls``): imported by
each worker process by its path, as RLHF code ships its own."""

import torch


class ProbeExtension:
    """Methods every worker gains: called by name with collective_rpc."""

    def embedding_sum(self) -> float:
        return float(self.model_runner.model.model.embed_tokens.weight.double().sum())

    def scale_embeddings(self, factor: float) -> bool:
        with torch.no_grad():
            self.model_runner.model.model.embed_tokens.weight.mul_(factor)
        return True


class ClashingExtension:
    """Would replace the worker's own load_model: refused."""

    def load_model(self) -> None:
        raise AssertionError("never called")
