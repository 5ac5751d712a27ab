"""The reference MoE inference engine: `from ft.engine.runner import LLMEngine`."""
