"""A GLM-10B-sized model (48 layers, hidden 4096, 64 heads, vocabulary 50,304) on the meta
device, for `glmc plan` (nothing is allocated): the seeds' 1,024-GPU questions,

    glmc plan examples/glm10b_meta.py --cluster 128x8:a100-80g --explain

print the plans' pipeline device utilisation and the gradient all-reduce (hierarchical
where the data-parallel group spans nodes). The example batch is the global batch: 1,024
sequences of 2,048 tokens. transformers' GLM-4 blocks (RMSNorm, rotary, gated MLP) stand in
for GLM-10B's."""
import torch
import transformers

cfg = transformers.GlmConfig(vocab_size=50304, hidden_size=4096, intermediate_size=10944,
                             num_hidden_layers=48, num_attention_heads=64,
                             num_key_value_heads=64, head_dim=64,
                             max_position_embeddings=2048, attention_dropout=0.0,
                             pad_token_id=0, use_cache=False)
with torch.device("meta"):
    model = transformers.GlmForCausalLM(cfg)
    ids = torch.zeros(1024, 2048, dtype=torch.long)
example_inputs = {"input_ids": ids, "labels": ids}
