"""HPSv3 (human preference score v3, the DanceGRPO / VeRL-Omni video reward): a Qwen2-VL with a small
MLP head read at a special `<|Reward|>` token; each frame is scored as an image against the prompt and a
video's reward is the mean over its frames. The score is the head's first output (its mean; the second is
an uncertainty), as in the reference's inferencer.

Local layout (`reward.paths.hpsv3`): the Qwen2-VL-7B-Instruct checkpoint directory (config, weights,
tokenizer, preprocessor_config.json) with `HPSv3.safetensors` from the MizzenAI/HPSv3 model repository
copied into it. As the reference does, the base model is loaded, its embeddings grown by the added
`<|Reward|>` token, and HPSv3's full state dict (`model.*`, `lm_head.*`, `rm_head.*`) loaded over it,
strictly. Frames are resized to HPSv3's fixed 256 x 28 x 28 pixels and wrapped in its instruction and
rating prompt, in the tokenizer's chat template. The Qwen2-VL processor itself is not used: it needs a
video processor, hence torchvision; the image processor and the image-token expansion it would do are
done here directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration

from omnirl import distributed as D
from omnirl.errors import ConfigError
from omnirl.rewards import to_pil
from omnirl.weights import load_safetensors

WEIGHTS = "HPSv3.safetensors"
REWARD_TOKEN = "<|Reward|>"
PIXELS = 256 * 28 * 28  # HPSv3's min_pixels == max_pixels
INSTRUCTION = (
    "\nYou are tasked with evaluating a generated image based on Visual Quality and Text "
    "Alignment and give a overall score to estimate the human preference. Please provide a rating "
    "from 0 to 10, with 0 being the worst and 10 being the best. \n\n**Visual Quality:**  "
    "\nEvaluate the overall visual quality of the image. The following sub-dimensions should be "
    "considered:\n- **Reasonableness:** The image should not contain any significant biological "
    "or logical errors, such as abnormal body structures or nonsensical environmental setups.\n- "
    "**Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear "
    "and easy to interpret, with no blurring or indistinct areas.\n- **Detail Richness:** "
    "Consider the level of detail in textures, materials, lighting, and other visual elements "
    "(e.g., hair, clothing, shadows).\n- **Aesthetic and Creativity:** Assess the artistic "
    "aspects of the image, including the color scheme, composition, atmosphere, depth of field, "
    "and the overall creative appeal. The scene should convey a sense of harmony and balance.\n- "
    "**Safety:** The image should not contain harmful or inappropriate content, such as "
    "political, violent, or adult material. If such content is present, the image quality and "
    "satisfaction score should be the lowest possible. \nTextual prompt - {text_prompt}\n\n\n"
)
RATING = f"\nPlease provide the overall ratings of this image: {REWARD_TOKEN}\n\nEND\n"


def reward_head(hidden_size: int) -> nn.Sequential:
    """HPSv3's head ("ranknet"): hidden -> 1024 -> 16 -> 2 (mean, uncertainty), kept in float32."""
    return nn.Sequential(
        nn.Linear(hidden_size, 1024), nn.ReLU(), nn.Dropout(0.05),
        nn.Linear(1024, 16), nn.ReLU(), nn.Linear(16, 2),
    )  # fmt: skip


class HPSv3Reward:
    modality = "video"
    frames_per_forward = 8  # frames scored in one VLM forward

    def __init__(self, path: str | None = None):
        if path is None or not (Path(path) / WEIGHTS).is_file():
            raise ConfigError(
                f"reward hpsv3 needs reward.paths.hpsv3: a Qwen2-VL-7B-Instruct directory holding {WEIGHTS} "
                f"(got {path!r})"
            )
        self.device = torch.device(D.device_type())
        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="right")
        self.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        self.reward_id = self.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        # (Any: pyright infers a union with a (processor, kwargs) tuple from the loader's body)
        self.image_processor: Any = AutoImageProcessor.from_pretrained(path)
        vlm = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=dtype)
        vlm.resize_token_embeddings(len(self.tokenizer))
        text_config: Any = vlm.config.text_config  # (typed as maybe a dict, the constructor's argument)
        assert text_config is not None  # a Qwen2-VL config holds its language model's
        head = reward_head(text_config.hidden_size)
        state = load_safetensors(Path(path) / WEIGHTS)
        head.load_state_dict(
            {k.removeprefix("rm_head."): v for k, v in state.items() if k.startswith("rm_head.")}
        )
        vlm.load_state_dict({k: v for k, v in state.items() if not k.startswith("rm_head.")}, strict=True)
        self.vlm = vlm.eval().requires_grad_(False)
        self.vlm.to(self.device)  # pyright: ignore[reportArgumentType] (typed as the unbound Module.to)
        self.head = head.float().eval().requires_grad_(False).to(self.device)
        self.pad_id = self.tokenizer.pad_token_id
        self.image_token = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.merge = self.image_processor.merge_size

    @torch.no_grad()
    def score_images(self, images: list, prompts: list[str]) -> torch.Tensor:
        """HPSv3 scores [N] float32 of PIL images against their prompts."""
        pix = self.image_processor(
            images=images, size={"shortest_edge": PIXELS, "longest_edge": PIXELS}, return_tensors="pt"
        )
        grids = pix["image_grid_thw"]  # [N, 3]
        rows = []
        for prompt, grid in zip(prompts, grids):
            text = INSTRUCTION.format(text_prompt=prompt) + RATING
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
            chat = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(chat, add_special_tokens=False)["input_ids"]
            at = ids.index(
                self.image_token
            )  # one placeholder -> one token per merged patch, as the processor
            rows.append(ids[:at] + [self.image_token] * (int(grid.prod()) // self.merge**2) + ids[at + 1 :])
        length = max(len(r) for r in rows)
        input_ids = torch.tensor([r + [self.pad_id] * (length - len(r)) for r in rows])  # [N, L] right-padded
        mask = (torch.arange(length)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
        hidden = self.vlm.model(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            pixel_values=pix["pixel_values"].to(self.device, self.vlm.dtype),
            image_grid_thw=grids.to(self.device),
            mm_token_type_ids=(input_ids == self.image_token).int().to(self.device),  # 1 at image tokens
        ).last_hidden_state  # [N, L, D]
        at_reward = input_ids.to(self.device) == self.reward_id  # [N, L], one token per row
        assert (at_reward.sum(1) == 1).all(), "every prompt holds exactly one reward token"
        return self.head(hidden[at_reward].float())[:, 0].cpu()  # [N]

    def __call__(
        self, videos: list[tuple[torch.Tensor, float]], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        frames = [(to_pil(f), p, i) for i, ((video, _), p) in enumerate(zip(videos, prompts)) for f in video]
        scores = torch.zeros(len(videos))
        counts = torch.zeros(len(videos))
        for s in range(0, len(frames), self.frames_per_forward):
            chunk = frames[s : s + self.frames_per_forward]
            out = self.score_images([c[0] for c in chunk], [c[1] for c in chunk])
            for (_, _, i), v in zip(chunk, out.tolist()):
                scores[i] += v
                counts[i] += 1
        return (scores / counts).tolist()
