"""vLLM's engine arguments that Sparrow does not take, each with the reason, so that a script
written for vLLM hears why rather than "unknown engine argument"; and the name check that uses
them (``EngineConfig.from_kwargs``, ``EngineArgs``, the CLI's "unrecognized arguments"). Re-exported
by ``sparrow.config``.
"""

from __future__ import annotations

from sparrow.config_base import ConfigError

# vLLM engine arguments Sparrow does not take, and why: a script written for vLLM gets the reason
# rather than "unknown engine argument".
VLLM_ARGUMENTS_NOT_TAKEN = {
    "swap_space": "Sparrow preempts by recomputation and never swaps KV blocks to host memory, so there is no "
                  "swap space to size",
    "cpu_offload_gb": "weights are not offloaded to host memory while serving (sleep mode offloads them between "
                      "rollouts: enable_sleep_mode)",
    "preemption_mode": "preemption always recomputes",
    "compilation_config": "Sparrow does not compile the model with torch.compile; CUDA graphs are on unless "
                          "enforce_eager=True",
    "max_seq_len_to_capture": "CUDA graphs cover decode steps up to max_num_seqs and mixed steps up to 512 tokens",
    "limit_mm_per_prompt": "Sparrow serves text-only models",
    "mm_processor_kwargs": "Sparrow serves text-only models",
    "speculative_model": "vLLM's older argument: give speculative_config={'model': ..., 'num_speculative_tokens': N}",
    "num_speculative_tokens": "vLLM's older argument: give speculative_config={..., 'num_speculative_tokens': N}",
    "num_scheduler_steps": "a vLLM V0 argument; V1, like Sparrow, schedules every step",
    "use_v2_block_manager": "a vLLM V0 argument; Sparrow has one block manager",
    "otlp_traces_endpoint": "Sparrow has no OpenTelemetry tracing; its metrics are Prometheus's (/metrics)",
    "max_num_partial_prefills": "vLLM V0's limit on prompts prefilled at once, removed in vLLM 0.27 (its V1 scheduler "
                                "never read it); Sparrow chunks any number of prompts within max_num_batched_tokens, "
                                "and long_prefill_token_threshold caps one prompt's share of a step",
    "max_long_partial_prefills": "vLLM V0's limit on long prompts prefilled at once, removed in vLLM 0.27; "
                                 "long_prefill_token_threshold caps one prompt's share of a step",
    "enable_eplb": "Sparrow has no expert-parallel load balancer: with enable_expert_parallel each rank keeps the "
                   "contiguous range of experts it loaded",
    "eplb_config": "Sparrow has no expert-parallel load balancer (enable_eplb)",
    "num_redundant_experts": "Sparrow has no expert-parallel load balancer, so no redundant experts",
    "cuda_graph_sizes": "CUDA graphs are captured for decode batches of 1, 2, 4, 8 and 16-512 in steps of 16 up to "
                        "max_num_seqs, and mixed steps up to 512 tokens; the sizes are not configurable "
                        "(enforce_eager=True turns graphs off)",
    "model_impl": "Sparrow runs its own model code for each architecture it lists (`sparrow plugins`); there is no "
                  "transformers fallback (an architecture plugin adds models)",
    "ignore_patterns": "Sparrow never downloads a model: it reads a local directory or the Hugging Face cache",
    "code_revision": "Sparrow never downloads model code: trust_remote_code runs the local directory's own",
    "hf_config_path": "the configuration is the model directory's config.json; hf_overrides changes its fields",
    "config_format": "Sparrow reads Hugging Face's config.json only (not Mistral's params.json)",
    "max_parallel_loading_workers": "each rank streams its weights from the safetensors files itself; the number of "
                                    "loading workers is not configurable",
    "tokenizer_pool_size": "a vLLM V0 argument; tokenization runs on the frontend's input thread",
    "guided_decoding_backend": "vLLM's older name for structured_outputs_config's backend; xgrammar is the only one "
                               "(structured_outputs_config={'backend': 'xgrammar'})",
    "enable_reasoning": "vLLM's older switch, removed there too: reasoning_parser alone splits the reasoning out",
    "max_cudagraph_capture_size": "CUDA graphs are captured for decode batches up to min(512, max_num_seqs) and mixed "
                                  "steps up to 512 tokens; the sizes are not configurable (enforce_eager=True turns "
                                  "graphs off)",
}


def check_engine_argument_name(name: str, owners: dict[str, str]) -> None:
    """ConfigError for a name that is not an engine argument: why, for a vLLM argument Sparrow
    does not take; else the valid names."""
    if name in owners:
        return
    if name in VLLM_ARGUMENTS_NOT_TAKEN:
        raise ConfigError(f"engine argument {name!r} (vLLM's) is not taken: {VLLM_ARGUMENTS_NOT_TAKEN[name]}")
    raise ConfigError(f"unknown engine argument {name!r}; valid arguments: {', '.join(sorted(owners))}")
