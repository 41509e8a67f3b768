"""Data plane: model runner, KV cache, speculative decoding, shard actors and the instance engine."""
