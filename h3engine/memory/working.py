"""Working memory (activations) of each phase of a request, and the FLOPs the cost model weighs copies against.

Each formula names the tensors it counts, read off the code that runs on a GPU (h3engine.models, ops, pipeline,
modulation; transformers' Qwen3-VL with SDPA). They are ESTIMATES: `phase_working` multiplies them by
WORKING_SAFETY for the allocator's rounding and fragmentation and for the small tensors left out, and they are to
be checked against measured peaks (torch.cuda.max_memory_allocated) on a GPU and corrected here.

Danger: a change in those code paths (another attention kernel, a kept intermediate, a larger decoder batch)
changes the real peak and not these numbers. Importing this module imports no torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from h3engine.memory.types import MODULATION_CACHE_SCHEDULES

if TYPE_CHECKING:
    from h3engine.memory.shapes import RequestShape
    from h3engine.memory.sizes import PartitionSizes

# Estimated activations are multiplied by this: the caching allocator rounds blocks up (to 2 MiB segments and
# 512-byte steps) and keeps freed blocks of one size from serving a larger request (fragmentation), and the
# formulas leave out small tensors (index tensors, scalars, kernel workspaces of a few MB).
WORKING_SAFETY = 1.2
# Bytes of one fp32 element; the compute dtype's comes from the sizes (`PartitionSizes.dtype_bytes`).
FP32 = 4


def dit_forward_bytes(partition: PartitionSizes, shape: RequestShape, share: Any, chunks: int = 1) -> int:
    """The largest moment of one DiT forward (h3engine.models.dit, fused ops allocating only their outputs,
    FA4 / cuDNN attention: output and a small LSE, no S x S scores), on this rank's rows.

    With S rows (S / dit_sp on a sequence-parallel rank), hidden H, q/k/v width I and FFN width F (/ dit_tp); held
    through a block: the previous block's hidden and modulated rows (`run_blocks` keeps them while it runs): 2 x [S, H].
    Unchunked (`chunks` 1, or a tensor- or sequence-parallel rank, whose linears and Ulysses kernel do not chunk):
    * block, SwiGLU: the post-attention hidden and the FFN input (2 x [S, H]), fc1's [S, 2F] and swiglu's [S, F]
      (`--fp8-linear`'s FP8 GEMMs would add an fp32 [S, F] quotient and its e4m3 copy at fc2, left out);
    * block, attention: q, k, v and the new q, k of the fused QK-norm + RoPE (5 x [S, I]); on a sequence-parallel
      rank, at the exchange: q, k, v, their stack, the stack received and the output (10 x [S, I]);
    * embedding: fp32 patch projections of the video and audio rows, their compute-dtype copies, the packed [S, H];
    * head: the blocks' output and its modulated norm ([S, H] x 2), the gathered video rows in both dtypes.
    With `chunks` N > 1 on a single rank (h3engine.models.dit_chunks): row chunks of c = ceil(rows / N), head groups
    G = min(N, heads) of at most g = ceil(heads / G) heads (I_g = g x head_dim):
    * block, attention: the [S, I] output buffer, and one group's q, k, v and normed q, k (5 x [S, I_g]) or, after the
      groups, out_proj's output [S, H];
    * block, FFN: the post-attention hidden, the FFN input and its preallocated output (3 x [S, H]), one chunk's fc1
      [c, 2F] and swiglu [c, F]; the block's last fused op: the post-attention hidden, the FFN output and the new
      hidden and modulated (4 x [S, H]): with the 2 held, 6 x [S, H] is the floor whatever N;
    * embedding: the packed [S, H], then the text rows [Lt, H] being copied in or one chunk's fp32 patch projection
      and its compute-dtype cast (video or audio rows);
    * head: the blocks' output and its modulated norm (2 x [S, H]), one chunk of gathered video rows in both dtypes,
      the fp32 video velocities [Nv, C_v].
    Measured on an H100 at the released widths (38,222 rows, 3 x [S, H] held then): 4.98 GiB unchunked, 2.68 GiB from
    8 chunks on; this formula gave both to within 1 MB.
    """
    config, e = partition.dit_config, partition.dtype_bytes
    hidden, inner, ffn = config.hidden_size, config.inner_dim, config.ffn_dim
    tp, sp = share.dit_tp, share.dit_sp
    rows = math.ceil(shape.sequence_rows / sp)
    video, audio, everything = shape.total_video_rows, shape.total_audio_rows, shape.sequence_rows
    held = 2 * rows * hidden * e
    if chunks == 1 or tp > 1 or sp > 1:
        block = held + rows * (2 * hidden + 3 * ffn // tp) * e
        attention = held + rows * (10 if sp > 1 else 5) * (inner // tp) * e
        embed = (video + audio) * hidden * (FP32 + e) + everything * hidden * e
        head = 2 * everything * hidden * e + video * hidden * (e + FP32)
        return max(block, attention, embed, head)
    groups = min(chunks, config.num_heads)
    group_width = math.ceil(config.num_heads / groups) * config.head_dim
    chunk_rows = math.ceil(rows / chunks)
    video_chunk, audio_chunk = math.ceil(video / chunks), math.ceil(audio / chunks)
    attention = held + rows * (inner + max(5 * group_width, hidden)) * e
    ffn_phase = held + 3 * rows * hidden * e + chunk_rows * 3 * ffn * e
    last_fused_op = held + 4 * rows * hidden * e
    embed = everything * hidden * e + max(
        shape.text_rows * hidden * e, max(video_chunk, audio_chunk) * hidden * (FP32 + e)
    )
    head = (
        2 * everything * hidden * e
        + video_chunk * hidden * (e + FP32)
        + video * config.video_patch_dim * FP32
    )
    return max(attention, ffn_phase, last_fused_op, embed, head)


def dit_request_state_bytes(partition: PartitionSizes, shape: RequestShape) -> int:
    """What the denoising loop holds on the GPU for the whole request (h3engine.engine.sampling.denoise_steps.denoise):
    the text states [L, text_dim], the fp32 video and audio rows with their velocities and the Euler step's two
    temporaries, the layout's index and fp64 position tensors, and up to two prepared layouts (RoPE cos and sin
    [S, rotary] in the compute dtype, the AdaLN and timestep index [S] int64): the first step's, where both timesteps
    coincide, and the rest's."""
    config, e = partition.dit_config, partition.dtype_bytes
    rows = shape.sequence_rows
    text = shape.text_rows * config.text_dim * e
    latents = (
        4
        * FP32
        * (
            shape.total_video_rows * config.video_patch_dim
            + shape.total_audio_rows * config.audio_in_channels
        )
    )
    layout = rows * (8 + 3 * 8 + 8)  # tags, positions, the modality index (int64, fp64 x 3, int64)
    prepared = 2 * rows * (2 * config.rotary_dim * e + 2 * 8)
    return text + latents + layout + prepared


def step_cache_bytes(partition: PartitionSizes, shape: RequestShape, share: Any) -> int:
    """A step cache's share of a forward (h3engine.engine.sampling.step_cache): the first blocks' residual and the middle
    blocks' one kept between forwards, and at the decision the new residual and the difference's |a - b| temporary
    (4 x [S, H] on this rank's rows; the per-row fp32 sums are small). None with cache "off"."""
    if not shape.step_cache:
        return 0
    rows = math.ceil(shape.sequence_rows / share.dit_sp)
    return 4 * rows * partition.dit_config.hidden_size * partition.dtype_bytes


def adaln_table_bytes(partition: PartitionSizes, shape: RequestShape) -> int:
    """The AdaLN tables of one schedule (h3engine.engine.sampling.modulation): per step, per block six [M * 3, H] tables, and the
    final layer's two [M, H]; built once per request and kept in the modulation cache."""
    config, e = partition.dit_config, partition.dtype_bytes
    levels, hidden = shape.timestep_levels, config.hidden_size
    per_step = config.num_layers * 6 * levels * 3 * hidden * e + 2 * levels * hidden * e
    return shape.steps * per_step


def adaln_cache_bytes(
    partition: PartitionSizes, shape: RequestShape, device_type: str, kept: int = MODULATION_CACHE_SCHEDULES
) -> int:
    """The AdaLN tables on a GPU: the request's own, and the `kept` schedules it keeps between requests
    (MODULATION_CACHE_SCHEDULES; none when the disk cache serves repeats)."""
    if device_type == "cpu":
        return 0
    return (kept + 1) * adaln_table_bytes(partition, shape)


def adaln_in_flight_bytes(partition: PartitionSizes, weights: str, device_type: str) -> int:
    """An AdaLN projection streamed to the GPU to build tables, and the next one arriving (two in flight); with FP8
    the stored copy and its unquantized one. None on the CPU (the projections stay with the module)."""
    dit = partition.dit
    if device_type == "cpu" or not dit.adaln_bytes:
        return 0
    one = dit.adaln_largest_compute_bytes + (dit.adaln_largest_bytes if weights == "fp8" else 0)
    return 2 * one


def text_encode_bytes(partition: PartitionSizes, shape: RequestShape, share: Any) -> int:
    """The text encoder's largest moment (transformers' Qwen3-VL with SDPA: an all-ones mask becomes `is_causal`,
    no [L, L] mask; grouped-query attention without repeating k and v).

    * vision tower (before the language layers; FL2VA / Ref2VA): pixel patches [P, 3 x t x p x p], the residual
      stream, its norm, qkv [P, 3V], attention output, the MLP's two [P, V_mlp] (all in the compute dtype);
    * language layer: embeddings and residual stream, the norm and the layer's output (4 x [L, D]), the SwiGLU's gate,
      its activation and up ([L, I / tp] x 3), while the merged vision features and the deepstack features of three
      vision levels ([T_vision, D] x 4) wait to be added.
    """
    dims, e = partition.text_dims, partition.dtype_bytes
    tp, tokens, patches = share.encoder_tp, shape.text_rows, shape.vision_patches
    pixels = patches * 3 * dims.temporal_patch * dims.vision_patch**2 * e
    vision = pixels + patches * (7 * dims.vision_hidden + 2 * dims.vision_intermediate) * e
    features = shape.vision_tokens * dims.hidden * (1 + dims.deepstack_levels) * e
    attention = tokens * (4 * dims.hidden + 4 * dims.heads * dims.head_dim // tp) * e
    language = max(tokens * (4 * dims.hidden + 3 * dims.intermediate // tp) * e, attention) + features
    return max(vision, language)


def conditioning_bytes(partition: PartitionSizes, shape: RequestShape) -> int:
    """The VAE encoders' largest moment (FL2VA keyframes, Ref2VA references; h3engine.engine.conditioning).

    * video: the condition's pixels on the GPU as uint8 and four fp32 copies (the float cast, /255, the ImageNet
      normalization's two steps; a clip padded to whole 17-frame clips is concatenated once more), and one encoder
      tile at its first level (the widest: block_out_channels[0] x (clip + 2 causal frames) x the padded tile, fp32):
      the block's input, norm, SiLU, the two paddings and the convolution's output (5 such tensors);
    * audio: the DAC-style encoder at the waveform's rate: encoder_dim channels x samples x 2 channels, fp32, about six
      such tensors (residual units' input, Snake activations, padded and convolved outputs).
    """
    if not shape.encode_clip_frames and not shape.encode_audio_samples:
        return 0
    video_config, audio_config = partition.video_config, partition.audio_config
    video = 0
    if shape.encode_clip_frames:
        pixels = shape.encode_pixels * 3 * (1 + 4 * FP32)
        tile_h, tile_w = shape.encode_tile
        first_level = (
            video_config.block_out_channels[0] * (shape.encode_clip_frames + 2) * (tile_h + 2) * (tile_w + 2)
        )
        video = pixels + 5 * first_level * FP32
    audio = 6 * audio_config.encoder_dim * shape.encode_audio_samples * 2 * FP32
    return max(video, audio)


def decode_bytes(partition: PartitionSizes, shape: RequestShape) -> int:
    """The decode phase's largest moment (h3engine.engine.pipeline.decode): the audio, then the video window by window.

    * video decoder call (`VideoVAE.decode_batch`, fp16 autocast on a GPU): R token rows of the call; the fp32
      residual stream [R, h] and its fp16 norm, the SwiGLU's w1 output [R, 2f] and its [R, f] product (f = h x mult),
      the RoPE tables [R, rope] x 2;
    * a window's decoded tiles (fp32, before stitching) wait while its last call runs; stitching then holds the tiles,
      the stitched rows and the window (3 x the window's pixels, fp32);
    * audio (BigVGAN-style decoder, fp32, both channels as a batch of two): about ten tensors of the widest stage
      (channels x samples is the same at every stage after the first: decoder_dim / 2^(i+1) x prod(rates[:i+1]) x A):
      the anti-aliased activations run at twice the rate and three residual kernels add up.
    """
    video_config, audio_config = partition.video_config, partition.audio_config
    decode = shape.decode
    video = 0
    if decode is not None and partition.video_vae.total:
        hidden, ffn = video_config.decoder_hidden_size, video_config.decoder_ffn_inner_dim
        half = 2  # fp16 under autocast
        call = decode.largest_call_rows * (
            FP32 * hidden
            + half * hidden
            + half * 2 * ffn
            + half * ffn
            + 2 * half * video_config.decoder_rope_dim
        )
        tiles = decode.window_tile_elements * FP32
        window = decode.window_frames * shape.height * shape.width * 3 * FP32
        video = tiles + max(call, 3 * window)
    audio = 0
    if partition.audio_vae.total:
        widest, product = 0, 1
        for index, rate in enumerate(audio_config.decoder_rates):
            product *= rate
            widest = max(widest, audio_config.decoder_dim // 2 ** (index + 1) * product)
        audio = 10 * widest * shape.audio_latents * 2 * FP32
    return max(video, audio)


def phase_working(
    partition: PartitionSizes,
    shape: RequestShape,
    share: Any,
    weights: str,
    device_type: str,
    chunks: int = 1,
    adaln_cache: bool = False,
) -> dict[str, int]:
    """Estimated working bytes of each phase this request runs, WORKING_SAFETY included. The denoise phase adds the
    request state and the AdaLN projections in flight to the forward's activations (`chunks`: the DiT's activation
    chunks); with the AdaLN tables' disk cache, tables that must be computed are built before the first forward, so
    their projections in flight and the forward are never on the GPU together."""
    conditioning = conditioning_bytes(partition, shape) if shape.task != "t2va" else 0
    forward = dit_forward_bytes(partition, shape, share, chunks) + step_cache_bytes(partition, shape, share)
    in_flight = adaln_in_flight_bytes(partition, weights, device_type)
    denoise = dit_request_state_bytes(partition, shape) + (
        max(forward, in_flight) if adaln_cache else forward + in_flight
    )
    working = {
        "conditioning": conditioning,
        "text_encode": text_encode_bytes(partition, shape, share),
        "denoise": denoise,
        "decode": decode_bytes(partition, shape),
    }
    if shape.task == "t2va":
        del working["conditioning"]
    return {phase: math.ceil(value * WORKING_SAFETY) for phase, value in working.items()}


def dit_forward_flops(partition: PartitionSizes, shape: RequestShape) -> float:
    """FLOPs of one DiT forward: each block's four linears over every row (2 x rows x parameters) and its attention
    (4 x S^2 x I: QK^T and PV); the token refiner's blocks over the text rows only."""
    config, size = partition.dit_config, partition.dit
    rows, text = shape.sequence_rows, shape.text_rows
    linear = 2 * size.layer_parameters * (rows * config.num_layers + text * config.num_refiner_layers)
    attention = 4 * config.inner_dim * (rows**2 * config.num_layers + text**2 * config.num_refiner_layers)
    return float(linear + attention)


def text_encode_flops(partition: PartitionSizes, shape: RequestShape) -> float:
    """2 x tokens x parameters per decoder layer, plus causal attention (half of 4 x L^2 x heads x head_dim)."""
    dims, size = partition.text_dims, partition.text_encoder
    tokens = shape.text_rows
    per_layer = 2 * tokens * size.layer_parameters + 2 * tokens**2 * dims.heads * dims.head_dim
    return float(per_layer * size.num_layers)


def decoder_call_flops(partition: PartitionSizes, rows: int) -> float:
    """One video-decoder call of `rows` token rows: 2 x rows x parameters per block (attention over ~1,800-token
    tiles is a few percent more, left out)."""
    size = partition.video_vae
    return float(2 * rows * size.layer_parameters * size.num_layers)
