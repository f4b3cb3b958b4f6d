"""The runner: tokenizer, models, KV cache, sampling, generation, chat and the CLI."""
