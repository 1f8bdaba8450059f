"""Small models for the demo, the examples and the tests."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, fused_attention: bool = False):
        super().__init__()
        self.heads, self.fused = heads, fused_attention
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # a key bias gets no gradient
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        y = y.transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT: token + position embeddings, pre-norm blocks, tied LM head. Attention is
    written out (scores, mask, softmax) unless ``fused_attention``: then it is
    ``F.scaled_dot_product_attention``, whose fused kernels never hold the scores."""

    def __init__(self, vocab: int = 96, dim: int = 32, heads: int = 4, layers: int = 2,
                 seq: int = 16, fused_attention: bool = False):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, fused_attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def gpt_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _tiny_llava(vocab: int, layers: int, hidden: int, config: dict):
    """``tiny_hf("llava")``: a CLIP vision tower projected into a Llama text model."""
    import transformers as T

    vision = T.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=4, image_size=16, patch_size=4,
                                num_channels=3, projection_dim=32, attention_dropout=0.0)
    text = T.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64,
                         use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return T.LlavaForConditionalGeneration(T.LlavaConfig(**{
        **dict(vision_config=vision, text_config=text, image_token_index=vocab - 1,
               vision_feature_layer=-1, vision_feature_select_strategy="default"),
        **config}))


def tiny_hf(name: str, vocab: int = 96, layers: int = 2, hidden: int = 64, **config):
    """A Hugging Face model at a tiny random configuration, built from its config (no weights
    fetched); dropout off, no KV cache. ``config`` overrides fields of the model's config.

    - ``gpt2``, ``llama``, ``qwen2`` (biases on the attention's q/k/v): causal LMs; ``bert``:
      a masked LM;
    - ``t5``: an encoder-decoder (``layers`` each side);
    - ``vit``: an image classifier over ``vocab`` classes, 16 x 16 images in 4 x 4 patches;
    - ``mixtral``, ``qwen3_moe``, ``deepseek_v3``: mixture-of-experts causal LMs with 4
      experts, top-2 routing and 4 attention heads, keeping transformers' default experts
      implementation (``grouped_mm``). DeepSeek-V3's first layer is dense, the others MoE (one
      shared expert, 2 groups of 2 experts, top-1 group); its router's score correction bias
      (a buffer, zero after init) is given small random values so the test models exercise
      it;
    - ``llava``: a LLaVA image-text model (``LlavaForConditionalGeneration``): a CLIP vision
      tower over 16 x 16 images in 4 x 4 patches, so 16 image features per image (the class
      token dropped), projected into a Llama text model; ``vocab - 1`` is the image token,
      which a call's ``input_ids`` hold once per image feature."""
    import transformers as T

    if name == "llava":
        return _tiny_llava(vocab, layers, hidden, config)
    moe = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
               num_attention_heads=4, max_position_embeddings=64, num_experts_per_tok=2,
               use_cache=False, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
               pad_token_id=0)
    known = {
        "gpt2": (T.GPT2LMHeadModel, T.GPT2Config, dict(
            n_layer=layers, n_embd=hidden, n_head=4, vocab_size=vocab, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0,
            eos_token_id=0)),
        "llama": (T.LlamaForCausalLM, T.LlamaConfig, dict(
            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
            max_position_embeddings=64, use_cache=False, bos_token_id=0, eos_token_id=0,
            pad_token_id=0)),
        "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config, dict(
            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
            max_position_embeddings=64, use_cache=False, bos_token_id=0, eos_token_id=0,
            pad_token_id=0, tie_word_embeddings=False)),
        "bert": (T.BertForMaskedLM, T.BertConfig, dict(
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
            intermediate_size=2 * hidden, vocab_size=vocab, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, max_position_embeddings=64, pad_token_id=0)),
        "t5": (T.T5ForConditionalGeneration, T.T5Config, dict(
            vocab_size=vocab, d_model=hidden, d_kv=hidden // 4, d_ff=2 * hidden,
            num_layers=layers, num_decoder_layers=layers, num_heads=4, dropout_rate=0.0,
            use_cache=False, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
        "vit": (T.ViTForImageClassification, T.ViTConfig, dict(
            image_size=16, patch_size=4, num_channels=3, hidden_size=hidden,
            num_hidden_layers=layers, num_attention_heads=4, intermediate_size=2 * hidden,
            num_labels=vocab, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        "mixtral": (T.MixtralForCausalLM, T.MixtralConfig, dict(
            **moe, intermediate_size=hidden, num_key_value_heads=2, num_local_experts=4,
            router_jitter_noise=0.0)),
        "qwen3_moe": (T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, dict(
            **moe, intermediate_size=2 * hidden, moe_intermediate_size=hidden,
            num_key_value_heads=2, num_experts=4, norm_topk_prob=True, decoder_sparse_step=1)),
        "deepseek_v3": (T.DeepseekV3ForCausalLM, T.DeepseekV3Config, dict(
            **moe, intermediate_size=2 * hidden, moe_intermediate_size=hidden,
            num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, n_group=2,
            topk_group=1, first_k_dense_replace=1 if layers > 1 else 0, q_lora_rank=32,
            kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            num_mtp_layers=0)),
    }
    if name not in known:
        raise KeyError(f"no tiny Hugging Face model {name!r}; use one of "
                       f"{', '.join([*known, 'llava'])}")
    model_cls, config_cls, fields = known[name]
    model = model_cls(config_cls(**{**fields, **config}))
    if name == "deepseek_v3":
        with torch.no_grad():
            for mod in model.modules():
                bias = getattr(mod, "e_score_correction_bias", None)
                if bias is not None:
                    bias.copy_(0.05 * torch.randn(bias.shape, dtype=bias.dtype,
                                                  device=bias.device))
    return model
