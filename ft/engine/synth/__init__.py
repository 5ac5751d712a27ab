"""`ft model synth`: synthetic checkpoints in the Hugging Face layout, with a tokenizer."""
