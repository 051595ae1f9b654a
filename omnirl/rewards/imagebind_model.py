"""ImageBind's vision, audio and text towers (Girdhar et al. 2023), in torch alone, loading the official
`imagebind_huge.pth`.

No maintained ImageBind package installs cleanly beside this project's torch, so the three towers a
reward needs are written here, with the official repository's module names so the official file's keys
load as they are. `ImageBind` holds the towers (`vision`, `audio`, `text`); `load_imagebind` builds it
and matches every key and shape of the file, names the first that is missing, unknown or of another
shape, and skips only the towers not built here (depth, thermal, IMU).

How it works: docs/rewards.md#imagebind
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from omnirl.errors import ConfigError
from omnirl.weights import torch_load


@dataclass(frozen=True)
class Tower:
    dim: int
    blocks: int
    heads: int


@dataclass(frozen=True)
class ImageBindArch:
    """The widths and depths of the three towers; the input geometry is fixed by the checkpoint."""

    vision: Tower
    audio: Tower
    text: Tower
    out_dim: int
    vocab_size: int = 49408  # OpenAI CLIP's BPE


# imagebind_huge() of the official repository.
HUGE = ImageBindArch(Tower(1280, 32, 16), Tower(768, 12, 12), Tower(1024, 24, 16), out_dim=1024)
IMAGE_SIZE, VIDEO_FRAMES, PATCH = 224, 2, (2, 14, 14)  # a vision clip [3, 2, 224, 224] -> 16 x 16 patches
MEL_BINS, MEL_FRAMES, AUDIO_KERNEL, AUDIO_STRIDE = 128, 204, 16, 10  # [1, 128, 204] -> 12 x 19 patches
CONTEXT = 77  # text tokens
BUILT = ("vision", "audio", "text")
UNUSED = ("depth", "thermal", "imu")  # towers of the checkpoint not built here: their keys are skipped


class Stem(nn.Module):
    """Patches to tokens [B, L, D]: `proj` (a convolution), then an optional `norm_layer`."""

    def __init__(self, proj: nn.Module, norm_layer: nn.Module | None = None):
        super().__init__()
        self.proj = proj
        self.norm_layer = norm_layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).flatten(2).transpose(1, 2)
        return x if self.norm_layer is None else self.norm_layer(x)


class RepeatToTwoFrames(nn.Module):
    """An image [B, 3, H, W] or a one-frame clip as a two-frame clip [B, 3, 2, H, W] (the official
    PadIm2Video, repeat mode); a two-frame clip passes as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 4:
            x = x.unsqueeze(2)
        return x.expand(-1, -1, VIDEO_FRAMES, -1, -1) if x.shape[2] == 1 else x


class PosEmbedding(nn.Module):
    def __init__(self, tokens: int, dim: int):
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens, dim))


class PatchPreprocessor(nn.Module):
    """Vision and audio: the stem's patches after a class token, plus learned positions."""

    def __init__(self, stem: Stem, patches: int, dim: int):
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.rgbt_stem = stem
        self.pos_embedding_helper = PosEmbedding(1 + patches, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.rgbt_stem(x)  # [B, L, D]
        tokens = torch.cat([self.cls_token.expand(len(tokens), -1, -1), tokens], dim=1)
        pos = self.pos_embedding_helper.pos_embed
        if tokens.shape[1] != pos.shape[1]:
            raise ValueError(
                f"ImageBind input of {tokens.shape[1] - 1} patches; the checkpoint has {pos.shape[1] - 1}"
            )
        return tokens + pos


class TextPreprocessor(nn.Module):
    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, CONTEXT, dim))
        self.register_buffer(
            "mask", torch.full((CONTEXT, CONTEXT), float("-inf")).triu(1)
        )  # causal, additive

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.token_embedding(ids) + self.pos_embed


class Mlp(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm attention and MLP (the official BlockWithMasking without drop-path, which is off at eval)."""

    def __init__(self, tower: Tower, bias_kv: bool):
        super().__init__()
        self.attn = nn.MultiheadAttention(tower.dim, tower.heads, add_bias_kv=bias_kv, batch_first=True)
        self.norm_1 = nn.LayerNorm(tower.dim, eps=1e-6)
        self.mlp = Mlp(tower.dim)
        self.norm_2 = nn.LayerNorm(tower.dim, eps=1e-6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        h = self.norm_1(x)
        x = x + self.attn(h, h, h, need_weights=False, attn_mask=mask)[0]
        return x + self.mlp(self.norm_2(x))


class Trunk(nn.Module):
    def __init__(self, tower: Tower, pre_norm: bool, bias_kv: bool):
        super().__init__()
        self.pre_transformer_layer = nn.Sequential(
            nn.LayerNorm(tower.dim, eps=1e-6) if pre_norm else nn.Identity()
        )
        self.blocks = nn.Sequential(*[Block(tower, bias_kv) for _ in range(tower.blocks)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.pre_transformer_layer(x)
        for block in self.blocks:
            x = block(x, mask)
        return x


class SelectFirst(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0]


class TextHead(nn.Module):
    """The end-of-text token's output, normed and projected."""

    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.proj = nn.Sequential(nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, out_dim, bias=False))

    def forward(self, x: torch.Tensor, eot: torch.Tensor) -> torch.Tensor:
        return self.proj(x[torch.arange(len(x)), eot])


def token_head(dim: int, out_dim: int) -> nn.Sequential:
    """Vision and audio: the class token's output, normed and projected (keys 0.* and 2.weight)."""
    return nn.Sequential(nn.LayerNorm(dim, eps=1e-6), SelectFirst(), nn.Linear(dim, out_dim, bias=False))


class Normalize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(x, dim=-1)


class LogitScale(nn.Module):
    """x times exp(log_logit_scale), capped at 100: a parameter for text, a buffer for audio (both are in
    the checkpoint)."""

    def __init__(self, learnable: bool):
        super().__init__()
        if learnable:
            self.log_logit_scale = nn.Parameter(torch.zeros(()))
        else:
            self.register_buffer("log_logit_scale", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.log_logit_scale.exp().clamp(max=100) * x


class ImageBind(nn.Module):
    def __init__(self, arch: ImageBindArch):
        super().__init__()
        v, a, t = arch.vision, arch.audio, arch.text
        vision_stem = Stem(nn.Sequential(RepeatToTwoFrames(), nn.Conv3d(3, v.dim, PATCH, PATCH, bias=False)))
        audio_stem = Stem(
            nn.Conv2d(1, a.dim, AUDIO_KERNEL, AUDIO_STRIDE, bias=False), norm_layer=nn.LayerNorm(a.dim)
        )
        audio_patches = ((MEL_BINS - AUDIO_KERNEL) // AUDIO_STRIDE + 1) * (
            (MEL_FRAMES - AUDIO_KERNEL) // AUDIO_STRIDE + 1
        )
        self.modality_preprocessors = nn.ModuleDict(
            {
                "vision": PatchPreprocessor(vision_stem, (IMAGE_SIZE // PATCH[1]) ** 2, v.dim),
                "text": TextPreprocessor(arch.vocab_size, t.dim),
                "audio": PatchPreprocessor(audio_stem, audio_patches, a.dim),
            }
        )
        self.modality_trunks = nn.ModuleDict(
            {
                "vision": Trunk(v, pre_norm=True, bias_kv=False),
                "text": Trunk(t, pre_norm=False, bias_kv=False),
                "audio": Trunk(a, pre_norm=False, bias_kv=True),
            }
        )
        self.modality_heads = nn.ModuleDict(
            {
                "vision": token_head(v.dim, arch.out_dim),
                "text": TextHead(t.dim, arch.out_dim),
                "audio": token_head(a.dim, arch.out_dim),
            }
        )
        self.modality_postprocessors = nn.ModuleDict(
            {
                "vision": Normalize(),
                "text": nn.Sequential(Normalize(), LogitScale(learnable=True)),
                "audio": nn.Sequential(Normalize(), LogitScale(learnable=False)),
            }
        )

    def vision(self, clips: torch.Tensor) -> torch.Tensor:
        """Clips [N, 3, 2, 224, 224] (normalised pixels) -> unit embeddings [N, out_dim]."""
        tokens = self.modality_trunks["vision"](self.modality_preprocessors["vision"](clips))
        return self.modality_postprocessors["vision"](self.modality_heads["vision"](tokens))

    def audio(self, mels: torch.Tensor) -> torch.Tensor:
        """Log-mel clips [N, 1, 128, 204] (normalised) -> embeddings [N, out_dim] (unit length x 20)."""
        tokens = self.modality_trunks["audio"](self.modality_preprocessors["audio"](mels))
        return self.modality_postprocessors["audio"](self.modality_heads["audio"](tokens))

    def text(self, ids: torch.Tensor, eot: torch.Tensor) -> torch.Tensor:
        """Token ids [N, 77] with the end-of-text positions [N] -> embeddings [N, out_dim] (unit length x the
        learned scale)."""
        pre = self.modality_preprocessors["text"]
        tokens = self.modality_trunks["text"](pre(ids), pre.mask)
        return self.modality_postprocessors["text"](self.modality_heads["text"](tokens, eot))


def load_imagebind(path: str, arch: ImageBindArch = HUGE) -> ImageBind:
    """The three towers with the official checkpoint's weights at `path`: every key of the towers built
    here present with its shape, every other key one of the unused towers'; else a ConfigError naming the
    file and the key."""
    state = torch_load(path, mmap=True)  # 4.5 GB: not read twice
    if not isinstance(state, dict):
        raise ConfigError(f"{path}: not a state dict (a {type(state).__name__}); expected imagebind_huge.pth")
    model = ImageBind(arch)
    ours = model.state_dict()
    unused = tuple(
        f"modality_{part}.{m}."
        for part in ("preprocessors", "trunks", "heads", "postprocessors")
        for m in UNUSED
    )
    for key in state:
        if key not in ours and not key.startswith(unused):
            raise ConfigError(f"{path}: key {key!r} is not one of ImageBind's (an unmapped key)")
    for key, tensor in ours.items():
        if key not in state:
            raise ConfigError(f"{path}: lacks {key!r} (ImageBind's {key.split('.')[1]} tower)")
        if state[key].shape != tensor.shape:
            raise ConfigError(
                f"{path}: {key!r} has shape {list(state[key].shape)}; this ImageBind's is "
                f"{list(tensor.shape)}"
            )
    model.load_state_dict({k: state[k] for k in ours}, strict=True)
    return model
