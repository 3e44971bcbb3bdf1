"""Multi-LoRA serving: adapter requests, PEFT loading, adapter slots and the batched op."""
