"""Benchmark models from libraries other than transformers and this repository: torchtitan's
llama3, and x-transformers' Llama-style decoder and encoder-decoder (``.ci/run`` installs both,
pinned). Each builder raises ``ModuleNotFoundError`` naming the library when it is missing;
``bench.compare`` skips that model then."""

from __future__ import annotations

import importlib.util
import sys
import types

import torch
import torch.nn as nn

DIM, LAYERS, HEADS, SEQ = 128, 4, 4, 64


def _need(module: str, package: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(f"{package} is not installed (.ci/run installs it pinned)",
                                  name=module)


def titan_kernels_stand_in() -> None:
    """torchtitan's model package imports its expert-parallel dispatch kernels
    (``torchtitan.distributed.minimal_async_ep.kernels``) at import time, and that module
    imports Triton at its top, for CUDA kernels that only expert-parallel MoE layers launch.
    Without Triton (torch's CPU build does not bring it) that module is replaced by one
    whose every kernel raises when called: the dense llama3 model never calls one, and a
    call would fail loudly rather than compute something else. Nothing named ``triton`` is
    put in ``sys.modules``, so torch's own Triton detection is untouched."""
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    mod = types.ModuleType(name, "stand-in: these kernels need Triton and CUDA")

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def kernel(*args, **kwargs):
            raise RuntimeError(f"{name}.{attr} needs Triton and CUDA "
                               "(expert-parallel MoE dispatch only)")
        return kernel

    mod.__getattr__ = __getattr__
    sys.modules[name] = mod


def titan_llama3(vocab: int, *, dim: int = DIM, layers: int = LAYERS, heads: int = HEADS,
                 kv_heads=HEADS // 2, seq: int = SEQ) -> nn.Module:
    """torchtitan's llama3 built as torchtitan builds its flavours (fused QKV, RoPE with llama
    scaling over a table of ``seq`` positions, grouped-query attention with ``kv_heads``
    key/value heads (None: torchtitan's default, one per head), its ``init_weights``), by
    default at width 128, 4 layers, 4 heads (2 key/value heads), with SDPA attention (the
    flavour's FlexAttention compiles for minutes on CPU). ``model.layers`` is a ModuleDict of
    the blocks."""
    _need("torchtitan", "torchtitan")
    titan_kernels_stand_in()
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.feed_forward import compute_ffn_hidden_dim
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, Llama3Model,
                                          _build_llama3_layers, _output_linear_init)

    blocks = _build_llama3_layers(
        fuse_qkv=True, n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=kv_heads,
        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=64),
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=seq, theta=500000,
                                scaling="llama"),
        attn_backend="flex")
    for block in blocks:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init=_output_linear_init(dim)),
        layers=blocks)
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.train()


def x_llama(vocab: int) -> nn.Module:
    """x-transformers' decoder configured as Llama is: rotary embeddings, RMSNorm, SwiGLU
    feed-forward without biases, grouped-query attention (2 key/value heads), no absolute
    positions; width 128, 4 layers, 4 heads, SDPA attention."""
    _need("x_transformers", "x-transformers")
    from x_transformers import Decoder, TransformerWrapper

    return TransformerWrapper(
        num_tokens=vocab, max_seq_len=SEQ, use_abs_pos_emb=False,
        attn_layers=Decoder(dim=DIM, depth=LAYERS, heads=HEADS, attn_kv_heads=HEADS // 2,
                            rotary_pos_emb=True, use_rmsnorm=True, ff_swish=True, ff_glu=True,
                            ff_mult=2, ff_no_bias=True, attn_flash=True))


class XEncoderDecoder(nn.Module):
    """x-transformers' ``XTransformer`` (encoder, decoder with cross-attention, token
    embeddings tied), 3 layers each side, width 128, 4 heads. ``XTransformer.forward``
    returns its own loss; this calls its encoder and its decoder's network and returns the
    decoder's logits, as the other benchmark models do."""

    def __init__(self, vocab: int):
        super().__init__()
        _need("x_transformers", "x-transformers")
        from x_transformers import XTransformer

        self.xt = XTransformer(dim=DIM, enc_num_tokens=vocab, enc_depth=3, enc_heads=HEADS,
                               enc_max_seq_len=SEQ, dec_num_tokens=vocab, dec_depth=3,
                               dec_heads=HEADS, dec_max_seq_len=SEQ, tie_token_emb=True)

    def forward(self, src, tgt):
        enc = self.xt.encoder(src, return_embeddings=True)
        return self.xt.decoder.net(tgt, context=enc)
