"""Real models whose training loop changes what forward reads: Hugging Face Wav2Vec2's
Gumbel quantizer, whose temperature its pretraining example anneals on every step
(``set_gumbel_temperature``). The sharded model trains as eager does, capturing twice."""

import warnings

import torch
import torch.nn as nn

from autoshard import autoshard


def _config():
    import transformers as T

    return T.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, codevector_dim=16,
        proj_codevector_dim=16, num_codevectors_per_group=8, num_codevector_groups=2,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, do_stable_layer_norm=True,
        feat_extract_norm="layer")


class Pretrain(nn.Module):
    """Wav2Vec2's encoder and its Gumbel vector quantizer with a small contrastive-free
    objective: the projected context should predict the quantized features, and the
    codebook should be used evenly (the quantizer's perplexity)."""

    def __init__(self, config):
        import transformers as T
        from transformers.models.wav2vec2.modeling_wav2vec2 import (
            Wav2Vec2GumbelVectorQuantizer)

        super().__init__()
        self.wav2vec2 = T.Wav2Vec2Model(config)
        self.quantizer = Wav2Vec2GumbelVectorQuantizer(config)
        self.project = nn.Linear(config.hidden_size, config.codevector_dim)
        self.groups = config.num_codevector_groups * config.num_codevectors_per_group
        # what Wav2Vec2PreTrainedModel._init_weights does for the quantizer, which outside a
        # pretrained model class nothing else initialises (its codevectors start empty)
        nn.init.normal_(self.quantizer.weight_proj.weight, std=1.0)
        nn.init.zeros_(self.quantizer.weight_proj.bias)
        nn.init.uniform_(self.quantizer.codevectors)

    def set_gumbel_temperature(self, temperature: float):  # as Wav2Vec2ForPreTraining's
        self.quantizer.temperature = temperature

    def forward(self, audio, mask_time_indices):
        hidden = self.wav2vec2(audio).last_hidden_state
        features = self.wav2vec2.feature_extractor(audio).transpose(1, 2)
        quantized, perplexity = self.quantizer(features, mask_time_indices=mask_time_indices)
        diversity = (self.groups - perplexity) / self.groups
        return (self.project(hidden) - quantized).square().mean() + 0.1 * diversity


def test_wav2vec2_gumbel_temperature_annealed_every_step_trains_as_eager():
    torch.manual_seed(0)
    config = _config()
    ref, model = Pretrain(config), Pretrain(config)
    model.load_state_dict(ref.state_dict())
    ref.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1 says so
        sharded = autoshard(model.train())
    audio = torch.randn(2, 800, generator=torch.Generator().manual_seed(1))
    frames = int(ref.wav2vec2._get_feat_extract_output_lengths(800))
    mask = torch.rand(2, frames, generator=torch.Generator().manual_seed(2)) < 0.5
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_s = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    for step in range(5):
        temperature = max(2.0 * 0.9 ** step, 0.5)  # the pretraining example's schedule
        ref.set_gumbel_temperature(temperature)
        sharded.set_gumbel_temperature(temperature)
        torch.manual_seed(step)  # the Gumbel noise: the same draws in both
        a = ref(audio, mask)
        torch.manual_seed(step)
        b = sharded(audio, mask)
        assert abs(a.item() - b.item()) <= 1e-6, (step, a.item(), b.item())
        a.backward()
        b.backward()
        for opt in (opt_r, opt_s):
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(ref.named_parameters(), sharded.parameters()):
        torch.testing.assert_close(q.full_tensor(), p.detach(), rtol=0, atol=1e-6, msg=name)
    # the temperature became an input after its first change: two captures, not five
    assert sum(len(v) for v in sharded._autoshard.variants.values()) == 2
