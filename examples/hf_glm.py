"""transformers' GlmForCausalLM from a config with random weights (no download).

Needs the `hf` extra (`pip install -e .[hf]`). As a glmc FILE: defines `workload()`.
    glmc compile examples/hf_glm.py --steps 5
"""
import torch


def workload(batch: int = 2, seq: int = 32, hidden: int = 64, layers: int = 2,
             vocab: int = 512):
    """Defaults: a tiny model for tests. The benchmark uses (4, 128, 256, 4, 8192)."""
    from transformers import GlmConfig, GlmForCausalLM

    config = GlmConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=hidden // 4, max_position_embeddings=max(128, seq),
                       attention_dropout=0.0, pad_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    model = GlmForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    example_inputs = {"input_ids": ids, "labels": ids.clone()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, example_inputs, None, optimizer
