"""Which layers of a model attend through a sliding window, read from its Hugging Face config.

Semantics are those of transformers: a layer with window ``W`` lets the token at position ``p``
attend to the keys at positions ``p - W + 1 .. p`` (``W`` keys, itself included).
"""

from __future__ import annotations

from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"


def layer_sliding_windows(hf_config: Any) -> list[int | None]:
    """One entry per decoder layer: its window in tokens, or None for full attention.

    ``layer_types`` (Gemma 2/3, Qwen2 with ``use_sliding_window``) names each layer's kind;
    without it a ``sliding_window`` applies to every layer (Mistral, Mixtral, Phi-3) unless
    ``use_sliding_window`` is false. Raises ValueError naming the config field that is wrong.
    """
    num_layers = int(hf_config.num_hidden_layers)
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"config.json sliding_window must be a positive integer or null, got {window!r}")
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        layer_types = list(layer_types)
        if len(layer_types) != num_layers:
            raise ValueError(f"config.json layer_types has {len(layer_types)} entries for "
                             f"{num_layers} num_hidden_layers")
        unknown = sorted({kind for kind in layer_types if kind not in (SLIDING, FULL)})
        if unknown:
            raise ValueError(f"config.json layer_types has unsupported kinds {unknown} "
                             f"(supported: {SLIDING!r}, {FULL!r})")
        if SLIDING in layer_types and window is None:
            raise ValueError("config.json layer_types names sliding_attention layers but sliding_window is null")
        return [window if kind == SLIDING else None for kind in layer_types]
    if window is None or getattr(hf_config, "use_sliding_window", True) is False:
        return [None] * num_layers
    return [window] * num_layers


def attended_windows(hf_config: Any) -> list[int | None]:
    """The window each layer attends through: ``layer_sliding_windows``, or full attention in every
    layer with vLLM's ``disable_sliding_window`` (set on the config by ``model_hf_config``), where a
    sliding layer keeps what else sets it apart (Gemma's local RoPE) and ``max_model_len`` is cut to
    the window, so that the outputs are the model's."""
    if getattr(hf_config, "disable_sliding_window", False):
        return [None] * int(hf_config.num_hidden_layers)
    return layer_sliding_windows(hf_config)
