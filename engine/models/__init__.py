"""Target and draft models: loading and versions, the forward paths (Hugging Face's and the
lean Llama-shaped one), and the runners with their KV caches."""
