"""LTX-2's rows: a clip's video tokens, then its sound's tokens.

``LTX2VideoTransformer3DModel`` denoises two streams at once: the video
VAE's latents (N, C, F, h, w) cut into ``(p_t, p, p)`` patches (1 x 1 x 1
in the released folders), flattened frame-major into ``F x h x w`` tokens
of ``C`` features (diffusers' ``_pack_latents``), and the audio VAE's mel
latents (N, C_a, L, M) as ``L`` tokens of ``C_a x M`` features
(``_pack_audio_latents``). A row here is both: the video tokens, then the
audio tokens, each zero-padded to the wider of the two feature widths (both
are 128 in the released LTX-2, 4 in the tiny folder). Every step between
calls is elementwise (the noise scheduler's Euler step, CFG), and both
streams share one sigma schedule (diffusers steps a copy of the video's
scheduler for the audio), so one scheduler over the joint row gives
diffusers' numbers.

A latent size is (F, h, w, L, fps in mHz): L, the audio latent frames,
follows from the clip's length in seconds (``num_frames / fps``) at the
audio VAE's 25 latents a second (16 kHz, hop 160, 4x), rounded as diffusers
rounds it; the frame rate the video positions are built at rides along, so
rows of one size share it.
"""

from __future__ import annotations

import torch

from diffrt.engine.pipelines.latents import LatentSize, SpatialLatents
from diffrt.engine.sampling import SamplingParams, filled


def pack_video(latents: torch.Tensor, patch: int, patch_t: int) -> torch.Tensor:
    """(N, C, F, h, w) -> (N, F/pt · h/p · w/p, C·pt·p·p), as diffusers' ``_pack_latents``."""
    n, c, f, h, w = latents.shape
    x = latents.reshape(n, c, f // patch_t, patch_t, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)


def unpack_video(tokens: torch.Tensor, size: tuple[int, int, int], patch: int,
                 patch_t: int) -> torch.Tensor:
    """The inverse of ``pack_video`` for latent frames, height, width ``size``."""
    f, h, w = size
    n = tokens.shape[0]
    x = tokens.reshape(n, f // patch_t, h // patch, w // patch, -1, patch_t, patch, patch)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)


class AudioVideoLatents(SpatialLatents):
    """LTX-2's ``latents.LatentLayout`` (see the module). ``channels``/``factor``
    are the video VAE's; ``audio_channels`` x ``mel_bins`` (latent mel bins)
    the audio's features; ``audio_rate`` the audio latents a second."""

    def __init__(self, channels: int, factor: int, temporal: int, patch: int, patch_t: int):
        super().__init__(channels, factor)
        self.temporal = temporal
        self.patch, self.patch_t = patch, patch_t
        self.video_width = channels * patch_t * patch * patch
        self.set_audio(0, 1, 0.0)

    def set_audio(self, channels: int, mel_bins: int, rate: float) -> None:
        """The audio VAE's latent channels, latent mel bins and latents a
        second (the pipeline reads them once the folder's audio VAE is
        loaded: ``LTX2Pipeline.take_components``)."""
        self.audio_channels, self.mel_bins, self.audio_rate = channels, mel_bins, rate
        self.audio_width = channels * mel_bins
        #: a row's features: the wider stream's (the other is zero-padded)
        self.width = max(self.video_width, self.audio_width)

    def audio_frames(self, params: SamplingParams) -> int:
        """The clip's audio latent frames: its seconds x ``audio_rate``,
        rounded (diffusers' rule), at least one."""
        seconds = filled(params.num_frames) / filled(params.fps)
        return max(1, round(seconds * self.audio_rate))

    def size(self, params: SamplingParams) -> LatentSize:
        frames = (filled(params.num_frames) - 1) // self.temporal + 1
        return (frames, filled(params.height) // self.factor, filled(params.width) // self.factor,
                self.audio_frames(params), round(filled(params.fps) * 1000))

    def video_tokens(self, size: LatentSize) -> int:
        f, h, w = size[:3]
        return (f // self.patch_t) * (h // self.patch) * (w // self.patch)

    def tokens(self, size: LatentSize) -> int:
        return self.video_tokens(size) + size[3]

    def noise(self, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
        """The request's first noise as rows, drawn as diffusers draws it:
        the clip's video latents for every output, then its audio latents,
        from the one generator."""
        n = params.num_outputs_per_prompt
        f, h, w, length, _ = self.size(params)
        video = torch.randn((n, self.channels, f, h, w), generator=generator, dtype=torch.float32)
        audio = torch.randn((n, self.audio_channels, length, self.mel_bins), generator=generator,
                            dtype=torch.float32)
        return self.join(pack_video(video, self.patch, self.patch_t), self.pack_audio(audio))

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """Rows pass as they are (``noise`` draws them as rows); video VAE
        latents (N, C, F, h, w) become video tokens."""
        if latents.dim() == 3:
            return latents
        return pack_video(latents, self.patch, self.patch_t)

    @staticmethod
    def pack_audio(latents: torch.Tensor) -> torch.Tensor:
        """(N, C, L, M) -> (N, L, C·M), as diffusers' ``_pack_audio_latents``."""
        return latents.transpose(1, 2).flatten(2, 3)

    def join(self, video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """Video tokens then audio tokens, each padded to ``width``."""
        pad = torch.nn.functional.pad
        return torch.cat([pad(video, (0, self.width - video.shape[-1])),
                          pad(audio, (0, self.width - audio.shape[-1]))], dim=1)

    def split(self, rows: torch.Tensor, size: LatentSize) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows -> (video tokens, audio tokens), each at its own width."""
        v = self.video_tokens(size)
        return rows[:, :v, :self.video_width], rows[:, v:, :self.audio_width]

    def unpack(self, tokens: torch.Tensor, size: LatentSize) -> torch.Tensor:
        """Rows -> the video VAE's latents (N, C, F, h, w) (the audio's: ``unpack_audio``)."""
        video, _ = self.split(tokens, size)
        f, h, w = size[:3]
        return unpack_video(video, (f, h, w), self.patch, self.patch_t)

    def unpack_audio(self, audio: torch.Tensor) -> torch.Tensor:
        """(N, L, C·M) audio tokens -> (N, C, L, M)."""
        return audio.unflatten(2, (-1, self.mel_bins)).transpose(1, 2)


__all__ = ["AudioVideoLatents", "pack_video", "unpack_video"]
