"""H3-AudioVAE: mono 32 kHz waveform <-> 32-channel latents at 40 latents/s (docs/MODEL.md §6).

* `encode(waveform [B, 1, N]) -> [B, C, ceil(N / hop)]`: right-padded with zeros to a hop multiple, DAC encoder ->
  causal-attention projection (`pre_block`) -> `mean_proj`: the posterior mean, all H3 uses (`logs_proj` is carried
  only so the state dict matches the checkpoint).
* `decode(latents [B, C, A]) -> [B, 1, hop * A]`: `dec_in_proj` -> BigVGAN, clamped to [-1, 1]. Latents going in
  are denormalized (`normalize_latents` / `denormalize_latents` apply the config's per-channel statistics).
* Stereo is two batch items of the mono model: `encode_stereo([2, N])`, `decode_stereo([2, C, A]) -> [2, hop * A]`.
* `state_dict()` keys are the native `audio_vae/model.safetensors` keys: weight-normed convs keep `weight_g` /
  `weight_v`; the Kaiser-sinc `filter` buffers and `pre_block.attn.zero_k_bias` are persistent, loaded from the file.

Dangers: fp32 only (the release runs it in fp32; bf16 loses decode accuracy): inputs are cast to fp32, and a global
`.to(torch.bfloat16)` must never sweep the model up. `fold_weight_norm()` caches `g * v / ||v||`; loading a state
dict drops the cache, editing `weight_g` / `weight_v` in place leaves it stale. The output clamp hides anything
beyond [-1, 1]. Fresh parameters are uninitialized; only the filters and `zero_k_bias` hold values before loading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# fmt: off
RELEASED_LATENTS_MEAN = (
    -0.020211687488382354, 0.3876466479950502, -0.04398279799186767, -0.28591514936373,
    0.08179686214561671, -0.35782641352446604, 0.040623809960919084, -0.01552534501956604,
    -0.223362481667332, 0.1821006842509091, 0.2941778783780663, -0.07901167601970885,
    -0.056815072777201, -0.3699028221860095, -0.31616315591624855, 0.5905951377425391,
    -0.052139568068853864, 0.013673160263486295, -0.03691647864630577, 0.09732660653298163,
    -0.3394662328788498, -0.30685677538541667, -0.24504598907458763, -0.034698524462007344,
    0.02868032184767538, -0.21217779266454084, -0.1678263169941987, 0.3221287889040614,
    -0.1223055851554907, 0.4356604928128464, -0.0502599202236253, 0.3979258376211797,
)
RELEASED_LATENTS_STD = (
    1.6895524230479284, 2.76263727217653, 1.7945344281264435, 1.6801681847309828,
    1.6390226546605453, 2.7788298348882177, 1.7659090095747236, 1.6199757612137327,
    2.6336525640336896, 1.8539356672817833, 2.5056497896915633, 1.811019237886178,
    1.9579657790720237, 1.6685498243529284, 1.4922469314453364, 3.298670198067373,
    1.9491804496832168, 1.8720003270431442, 1.8334080103291832, 1.6488070416529093,
    1.6176957696319716, 1.9131449234774398, 1.5695245398428617, 1.6943659940415912,
    1.8318420762504692, 1.5540637421583379, 1.9344930328968526, 1.599198216109855,
    1.718045989838149, 1.6307219190837705, 1.8661226051202384, 1.5613768203168363,
)
# fmt: on

# Values the released source hard-codes (keyed off the 32 kHz sample rate) instead of writing them to
# metadata.json; `audio_vae_format.config_to_native` writes a field only when it differs from these.
RELEASED_NUM_ATTENTION_HEADS = 8
RELEASED_RESBLOCK_KERNEL_SIZES = (3, 7, 11)
RELEASED_RESBLOCK_DILATION_SIZES = ((1, 3, 5), (1, 3, 5), (1, 3, 5))

# Architecture constants shared by the release and diffusers, not configurable in either.
ENCODER_RESIDUAL_DILATIONS = (1, 3, 9)
ENCODER_RESIDUAL_KERNEL_SIZE = 7
PRE_BLOCK_MLP_RATIO = 2
ANTI_ALIAS_RATIO = 2
ANTI_ALIAS_KERNEL_SIZE = 12
SNAKE_EPSILON = 1e-9
# Stereo is two batch items of the mono model (row 0 left, row 1 right).
STEREO_CHANNELS = 2


@dataclass(frozen=True)
class AudioVAEConfig:
    """Architecture and latent statistics of the audio VAE, the released values by default (docs/MODEL.md §6.1)."""

    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 4, 5, 5)
    latent_dim: int = 2048
    latent_channels: int = 32
    num_attention_heads: int = RELEASED_NUM_ATTENTION_HEADS
    decoder_dim: int = 1024
    decoder_rates: tuple[int, ...] = (5, 5, 2, 2, 2, 2, 2)
    decoder_kernel_sizes: tuple[int, ...] = (9, 9, 4, 4, 4, 4, 4)
    resblock_kernel_sizes: tuple[int, ...] = RELEASED_RESBLOCK_KERNEL_SIZES
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = RELEASED_RESBLOCK_DILATION_SIZES
    sampling_rate: int = 32000
    latents_mean: tuple[float, ...] = RELEASED_LATENTS_MEAN
    latents_std: tuple[float, ...] = RELEASED_LATENTS_STD

    def __post_init__(self) -> None:
        # JSON gives lists; normalize to tuples so the config stays hashable and compares by value.
        for name in ("encoder_rates", "decoder_rates", "decoder_kernel_sizes", "resblock_kernel_sizes"):
            object.__setattr__(self, name, tuple(int(value) for value in getattr(self, name)))
        object.__setattr__(
            self,
            "resblock_dilation_sizes",
            tuple(tuple(int(d) for d in dilations) for dilations in self.resblock_dilation_sizes),
        )
        for name in ("latents_mean", "latents_std"):
            object.__setattr__(self, name, tuple(float(value) for value in getattr(self, name)))

        if math.prod(self.decoder_rates) != self.hop_length:
            raise ValueError(
                f"decoder_rates {self.decoder_rates} upsample by {math.prod(self.decoder_rates)}, "
                f"but the encoder hop is {self.hop_length}"
            )
        if len(self.decoder_kernel_sizes) != len(self.decoder_rates):
            raise ValueError("decoder_kernel_sizes needs one entry per decoder rate")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            raise ValueError("resblock_kernel_sizes and resblock_dilation_sizes need the same length")
        if self.latent_dim % self.latent_channels or self.latent_dim % self.num_attention_heads:
            raise ValueError("latent_dim must be a multiple of latent_channels and of num_attention_heads")
        if self.decoder_dim % 2 ** len(self.decoder_rates):
            raise ValueError("decoder_dim must halve evenly at every upsampling stage")
        if len(self.latents_mean) != self.latent_channels or len(self.latents_std) != self.latent_channels:
            raise ValueError(f"latents_mean and latents_std need {self.latent_channels} values each")
        if min(self.latents_std) <= 0:
            raise ValueError("latents_std values must be positive")

    @property
    def hop_length(self) -> int:
        """Waveform samples per latent (800 released)."""
        return math.prod(self.encoder_rates)

    @classmethod
    def released(cls) -> AudioVAEConfig:
        return cls()

    @classmethod
    def tiny(cls) -> AudioVAEConfig:
        """Tiny test config with the released hop (800 samples = 40 latents/s at 32 kHz), so that tiny checkpoints
        encode reference audio to as many rows as the release does and decode clips of the real length; 4 latent
        channels, one AMP kernel."""
        rates = (8, 10, 10)
        return cls(
            encoder_dim=4,
            encoder_rates=rates,
            latent_dim=16,
            latent_channels=4,
            num_attention_heads=2,
            decoder_dim=16,
            decoder_rates=rates,
            decoder_kernel_sizes=tuple(2 * rate for rate in rates),
            resblock_kernel_sizes=(3,),
            resblock_dilation_sizes=((1,),),
            sampling_rate=32000,
            latents_mean=(0.25, -0.5, 0.125, -0.0625),
            latents_std=(0.75, 1.5, 1.25, 0.5),
        )


# ------------------------------------------------------------------------------------------------------------------
# Building blocks
# ------------------------------------------------------------------------------------------------------------------


class WeightNormedConv1d(nn.Module):
    """Conv1d / ConvTranspose1d with classic weight norm: `weight = g * v / ||v||`, norm over all dims but dim 0.

    Kept as our own module (not `torch.nn.utils.parametrizations.weight_norm`) so the parameters are named
    `weight_g` / `weight_v` like the checkpoint. For a transposed conv, dim 0 of `v` is the *input* channel, so
    `weight_g` is [in, 1, 1] there.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        *,
        stride: int = 1,
        padding: int = 0,
        dilation: int = 1,
        bias: bool = True,
        transposed: bool = False,
    ) -> None:
        super().__init__()
        self.stride = stride
        self.padding = padding
        self.dilation = dilation
        self.transposed = transposed
        direction_shape = (in_channels, out_channels) if transposed else (out_channels, in_channels)
        self.weight_g = nn.Parameter(torch.empty(direction_shape[0], 1, 1))
        self.weight_v = nn.Parameter(torch.empty(*direction_shape, kernel_size))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.register_buffer("folded_weight", None, persistent=False)

    def effective_weight(self) -> torch.Tensor:
        if self.folded_weight is not None:
            return self.folded_weight
        # torch's fused weight-norm kernel: the same norm reduction order as the reference, so bit-equal weights.
        return torch._weight_norm(self.weight_v, self.weight_g, 0)

    def fold(self) -> None:
        self.folded_weight = self.effective_weight().detach()

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        # New g / v make any folded weight stale.
        self.folded_weight = None
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.effective_weight()
        if self.transposed:
            return F.conv_transpose1d(hidden, weight, self.bias, stride=self.stride, padding=self.padding)
        return F.conv1d(
            hidden, weight, self.bias, stride=self.stride, padding=self.padding, dilation=self.dilation
        )


class Snake(nn.Module):
    """DAC Snake, `x + sin(alpha x)^2 / (alpha + 1e-9)`; alpha is stored raw as [1, C, 1]."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.empty(1, channels, 1))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + torch.sin(self.alpha * hidden).pow(2) / (self.alpha + SNAKE_EPSILON)


class SnakeBeta(nn.Module):
    """BigVGAN SnakeBeta, `x + sin(e^alpha x)^2 / (e^beta + 1e-9)`; alpha and beta are stored in log scale as [C]."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.empty(channels))
        self.beta = nn.Parameter(torch.empty(channels))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        frequency = self.alpha.exp()[None, :, None]
        magnitude = self.beta.exp()[None, :, None]
        return hidden + torch.sin(frequency * hidden).pow(2) / (magnitude + SNAKE_EPSILON)


def kaiser_sinc_lowpass(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """Sum-normalized Kaiser-windowed sinc low-pass kernel, [1, 1, kernel_size], fp32 on CPU.

    Computed in fp32 with the same steps as the alias-free-torch code the release was trained with, so the result
    matches the stored `filter` buffers bit for bit; the Kaiser beta follows Kaiser's empirical design formula.
    """
    half = kernel_size // 2
    attenuation_db = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation_db > 50.0:
        beta = 0.1102 * (attenuation_db - 8.7)
    elif attenuation_db >= 21.0:
        beta = 0.5842 * (attenuation_db - 21) ** 0.4 + 0.07886 * (attenuation_db - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(kernel_size, periodic=False, beta=beta, dtype=torch.float32, device="cpu")
    # Even kernels have no centre tap: sample the sinc half a step off the integers.
    if kernel_size % 2 == 0:
        taps = torch.arange(-half, half, device="cpu") + 0.5
    else:
        taps = torch.arange(kernel_size, device="cpu") - half
    kernel = 2 * cutoff * window * torch.sinc(2 * cutoff * taps)
    kernel = kernel / kernel.sum()
    return kernel.view(1, 1, kernel_size)


def anti_alias_filter() -> torch.Tensor:
    """The one filter every anti-aliased activation stores twice (up and down): cutoff 0.25, half-width 0.3."""
    return kaiser_sinc_lowpass(0.5 / ANTI_ALIAS_RATIO, 0.6 / ANTI_ALIAS_RATIO, ANTI_ALIAS_KERNEL_SIZE)


def _filter_buffer() -> torch.Tensor:
    # Computed on CPU for exact values, then placed wherever the model is being built (meta included).
    return anti_alias_filter().to(torch.get_default_device())


class KaiserUpsample(nn.Module):
    """2x upsampling: zero-stuffing transposed depthwise conv with the Kaiser-sinc kernel, replicate-padded."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("filter", _filter_buffer())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ratio, kernel_size = ANTI_ALIAS_RATIO, ANTI_ALIAS_KERNEL_SIZE
        input_pad = kernel_size // ratio - 1
        crop_left = input_pad * ratio + (kernel_size - ratio) // 2
        crop_right = input_pad * ratio + (kernel_size - ratio + 1) // 2
        channels = hidden.shape[1]
        hidden = F.pad(hidden, (input_pad, input_pad), mode="replicate")
        # The gain `ratio` restores the amplitude lost to the inserted zeros.
        hidden = ratio * F.conv_transpose1d(
            hidden, self.filter.expand(channels, -1, -1), stride=ratio, groups=channels
        )
        return hidden[..., crop_left:-crop_right]


class KaiserLowpass(nn.Module):
    """Strided depthwise Kaiser-sinc low-pass (2x decimation), replicate-padded to keep length / 2."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("filter", _filter_buffer())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kernel_size = ANTI_ALIAS_KERNEL_SIZE
        pad_left = kernel_size // 2 - (1 if kernel_size % 2 == 0 else 0)
        pad_right = kernel_size // 2
        channels = hidden.shape[1]
        hidden = F.pad(hidden, (pad_left, pad_right), mode="replicate")
        return F.conv1d(
            hidden, self.filter.expand(channels, -1, -1), stride=ANTI_ALIAS_RATIO, groups=channels
        )


class KaiserDownsample(nn.Module):
    """Holds the low-pass one level down only because the native keys read `downsample.lowpass.filter`."""

    def __init__(self) -> None:
        super().__init__()
        self.lowpass = KaiserLowpass()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lowpass(hidden)


class AntiAliasedSnakeBeta(nn.Module):
    """SnakeBeta evaluated at twice the sample rate (upsample -> activation -> downsample) to limit aliasing."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.act = SnakeBeta(channels)
        self.upsample = KaiserUpsample()
        self.downsample = KaiserDownsample()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.act(self.upsample(hidden)))


# ------------------------------------------------------------------------------------------------------------------
# Encoder (DAC)
# ------------------------------------------------------------------------------------------------------------------


class EncoderResidualUnit(nn.Module):
    """`x + conv1(Snake(conv7_dilated(Snake(x))))`; the dilated conv is padded to keep the length."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        kernel = ENCODER_RESIDUAL_KERNEL_SIZE
        self.block = nn.Sequential(
            Snake(channels),
            WeightNormedConv1d(
                channels, channels, kernel, dilation=dilation, padding=(kernel - 1) * dilation // 2
            ),
            Snake(channels),
            WeightNormedConv1d(channels, channels, 1),
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.block(hidden)


class EncoderBlock(nn.Module):
    """Three residual units on `out_channels / 2`, Snake, then a strided conv that doubles the width."""

    def __init__(self, out_channels: int, stride: int) -> None:
        super().__init__()
        in_channels = out_channels // 2
        self.block = nn.Sequential(
            *(EncoderResidualUnit(in_channels, dilation) for dilation in ENCODER_RESIDUAL_DILATIONS),
            Snake(in_channels),
            WeightNormedConv1d(
                in_channels, out_channels, 2 * stride, stride=stride, padding=math.ceil(stride / 2)
            ),
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.block(hidden)


class AudioEncoder(nn.Module):
    """[B, 1, N] -> [B, latent_dim, N / hop] for N a hop multiple."""

    def __init__(self, config: AudioVAEConfig) -> None:
        super().__init__()
        width = config.encoder_dim
        layers: list[nn.Module] = [WeightNormedConv1d(1, width, 7, padding=3)]
        for stride in config.encoder_rates:
            width *= 2
            layers.append(EncoderBlock(width, stride))
        layers.append(Snake(width))
        layers.append(WeightNormedConv1d(width, config.latent_dim, 3, padding=1))
        self.block = nn.Sequential(*layers)

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        return self.block(waveform)


# ------------------------------------------------------------------------------------------------------------------
# Latent projection (`pre_block`)
# ------------------------------------------------------------------------------------------------------------------


class HeadAveragedCausalAttention(nn.Module):
    """Causal self-attention whose heads are averaged (not concatenated), then pooled from head_dim to out_dim."""

    def __init__(self, in_dim: int, out_dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.out_dim = out_dim
        self.qkv = nn.Linear(in_dim, 3 * in_dim, bias=False)
        self.q_bias = nn.Parameter(torch.empty(in_dim))
        self.v_bias = nn.Parameter(torch.empty(in_dim))
        # Stored in the checkpoint, so persistent; a key bias cannot change causal softmax weights anyway.
        self.register_buffer("zero_k_bias", torch.zeros(in_dim))
        self.proj = nn.Linear(out_dim, out_dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, width = hidden.shape
        head_dim = width // self.num_heads
        qkv_bias = torch.cat((self.q_bias, self.zero_k_bias, self.v_bias))
        # Rows of `qkv` are [q; k; v] blocks, each split into heads.
        qkv = F.linear(hidden, self.qkv.weight, qkv_bias).view(batch, length, 3, self.num_heads, head_dim)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        averaged = attended.mean(dim=1)
        return self.proj(F.adaptive_avg_pool1d(averaged, self.out_dim))


class GatedGeluMlp(nn.Module):
    """Pre-norm GeGLU: `w2(gelu_tanh(w0 x) * w1 x)` on `LayerNorm(x)`."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w0 = nn.Linear(dim, hidden_dim)
        self.w1 = nn.Linear(dim, hidden_dim)
        self.w2 = nn.Linear(hidden_dim, dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.norm(hidden)
        return self.w2(F.gelu(self.w0(normed), approximate="tanh") * self.w1(normed))


class LatentProjection(nn.Module):
    """`pre_block`: [B, T, latent_dim] -> [B, T, latent_channels] (linear shortcut + attention, then GeGLU)."""

    def __init__(self, config: AudioVAEConfig) -> None:
        super().__init__()
        in_dim, out_dim = config.latent_dim, config.latent_channels
        self.norm1 = nn.LayerNorm(in_dim)
        self.attn = HeadAveragedCausalAttention(in_dim, out_dim, config.num_attention_heads)
        self.proj = nn.Linear(in_dim, out_dim)
        self.norm3 = nn.LayerNorm(in_dim)
        self.norm2 = nn.LayerNorm(out_dim)
        self.mlp = GatedGeluMlp(out_dim, out_dim * PRE_BLOCK_MLP_RATIO)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        projected = self.proj(self.norm3(hidden)) + self.attn(self.norm1(hidden))
        return projected + self.mlp(self.norm2(projected))


# ------------------------------------------------------------------------------------------------------------------
# Decoder (BigVGAN)
# ------------------------------------------------------------------------------------------------------------------


class AmpBlock(nn.Module):
    """BigVGAN AMP block: per dilation, `x += conv(act(conv_dilated(act(x))))` with anti-aliased SnakeBeta."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            WeightNormedConv1d(
                channels, channels, kernel_size, dilation=dilation, padding=(kernel_size - 1) * dilation // 2
            )
            for dilation in dilations
        )
        self.convs2 = nn.ModuleList(
            WeightNormedConv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2)
            for _ in dilations
        )
        # Interleaved: activations[2m] feeds convs1[m], activations[2m + 1] feeds convs2[m].
        self.activations = nn.ModuleList(AntiAliasedSnakeBeta(channels) for _ in range(2 * len(dilations)))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for index, (dilated_conv, plain_conv) in enumerate(zip(self.convs1, self.convs2, strict=True)):
            residual = dilated_conv(self.activations[2 * index](hidden))
            hidden = hidden + plain_conv(self.activations[2 * index + 1](residual))
        return hidden


class BigVganDecoder(nn.Module):
    """[B, latent_dim, A] -> [B, 1, hop * A] in [-1, 1]."""

    def __init__(self, config: AudioVAEConfig) -> None:
        super().__init__()
        self.kernels_per_stage = len(config.resblock_kernel_sizes)
        self.conv_pre = WeightNormedConv1d(config.latent_dim, config.decoder_dim, 7, padding=3)
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        channels = config.decoder_dim
        for rate, kernel in zip(config.decoder_rates, config.decoder_kernel_sizes, strict=True):
            # The one-element list reproduces the native `ups.{i}.0.*` keys.
            upsampler = WeightNormedConv1d(
                channels, channels // 2, kernel, stride=rate, padding=(kernel - rate) // 2, transposed=True
            )
            self.ups.append(nn.ModuleList([upsampler]))
            channels //= 2
            for resblock_kernel, dilations in zip(
                config.resblock_kernel_sizes, config.resblock_dilation_sizes, strict=True
            ):
                self.resblocks.append(AmpBlock(channels, resblock_kernel, dilations))
        self.activation_post = AntiAliasedSnakeBeta(channels)
        self.conv_post = WeightNormedConv1d(channels, 1, 7, padding=3, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.conv_pre(hidden)
        for stage, (upsampler,) in enumerate(self.ups):
            hidden = upsampler(hidden)
            first = stage * self.kernels_per_stage
            stage_blocks = self.resblocks[first : first + self.kernels_per_stage]
            # Sum in block order, then divide: the release's multi-receptive-field average.
            total = stage_blocks[0](hidden)
            for block in stage_blocks[1:]:
                total = total + block(hidden)
            hidden = total / self.kernels_per_stage
        hidden = self.conv_post(self.activation_post(hidden))
        return hidden.clamp(-1.0, 1.0)


# ------------------------------------------------------------------------------------------------------------------
# Full model
# ------------------------------------------------------------------------------------------------------------------


class AudioVAE(nn.Module):
    """H3-AudioVAE in fp32; see the module docstring for the contract."""

    def __init__(self, config: AudioVAEConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        with torch.device(device if device is not None else torch.get_default_device()):
            self.encoder = AudioEncoder(config)
            self.pre_block = LatentProjection(config)
            self.mean_proj = nn.Conv1d(config.latent_channels, config.latent_channels, 1)
            # Never evaluated by H3 (it uses the posterior mean); present so the checkpoint loads strictly.
            self.logs_proj = nn.Conv1d(config.latent_channels, config.latent_channels, 1)
            self.dec_in_proj = nn.Conv1d(config.latent_channels, config.latent_dim, 1)
            self.decoder = BigVganDecoder(config)

    def encode(self, waveform: torch.Tensor) -> torch.Tensor:
        """[B, 1, N] waveform in [-1, 1] -> posterior-mean latents [B, C, ceil(N / hop)] (fp32, unnormalized)."""
        if waveform.ndim != 3 or waveform.shape[1] != 1:
            raise ValueError(f"waveform must be [batch, 1, samples], got {tuple(waveform.shape)}")
        waveform = waveform.to(torch.float32)
        missing = -waveform.shape[-1] % self.config.hop_length
        if missing:
            waveform = F.pad(waveform, (0, missing))
        trunk = self.encoder(waveform)
        projected = self.pre_block(trunk.transpose(1, 2)).transpose(1, 2)
        return self.mean_proj(projected)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Denormalized latents [B, C, A] -> waveform [B, 1, hop * A] clamped to [-1, 1] (fp32)."""
        if latents.ndim != 3 or latents.shape[1] != self.config.latent_channels:
            raise ValueError(
                f"latents must be [batch, {self.config.latent_channels}, frames], got {tuple(latents.shape)}"
            )
        return self.decoder(self.dec_in_proj(latents.to(torch.float32)))

    def _latent_statistics(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 tensors built from the config floats, like the reference pipeline; shaped for [..., C, A].
        mean = torch.tensor(self.config.latents_mean, dtype=torch.float32, device=latents.device).view(-1, 1)
        std = torch.tensor(self.config.latents_std, dtype=torch.float32, device=latents.device).view(-1, 1)
        return mean, std

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents [..., C, A] -> DiT latents: `(z - mean) / std` per channel, in fp32."""
        mean, std = self._latent_statistics(latents)
        return (latents.to(torch.float32) - mean) / std

    def denormalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """DiT latents [..., C, A] -> VAE latents: `z * std + mean` per channel, in fp32."""
        mean, std = self._latent_statistics(latents)
        return latents.to(torch.float32) * std + mean

    def encode_stereo(self, waveform: torch.Tensor) -> torch.Tensor:
        """Stereo [2, N] (left, right) -> latents [2, C, ceil(N / hop)]; each channel is encoded as mono."""
        if waveform.ndim != 2 or waveform.shape[0] != STEREO_CHANNELS:
            raise ValueError(f"stereo waveform must be [2, samples], got {tuple(waveform.shape)}")
        return self.encode(waveform.unsqueeze(1))

    def decode_stereo(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [2, C, A] (left, right) -> stereo waveform [2, hop * A] in [-1, 1]."""
        if latents.ndim != 3 or latents.shape[0] != STEREO_CHANNELS:
            raise ValueError(f"stereo latents must be [2, channels, frames], got {tuple(latents.shape)}")
        return self.decode(latents).squeeze(1)

    def fold_weight_norm(self) -> None:
        """Cache every `g * v / ||v||` once (inference speed-up); results equal the unfolded model within fp32."""
        for module in self.modules():
            if isinstance(module, WeightNormedConv1d):
                module.fold()
