"""Data plane: Llama-family model, weight loaders, tokenizer, paged KV, model runner."""
