"""The model: Qwen3-MoE / Mixtral layers, attention, loading, tokenizer, sampling."""
