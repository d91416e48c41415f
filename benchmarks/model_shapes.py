"""Model shapes the benchmarks train (random init, config keyword arguments for transformers)."""

LLAMA_3_2_1B = dict(  # LlamaConfig
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)

QWEN2_5_05B = dict(  # Qwen2Config
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)
