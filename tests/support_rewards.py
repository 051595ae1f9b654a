"""A reward for trainer tests: JPEG compressibility, except rows flagged `constant`, which all score 0
(so their groups have zero spread and are dropped)."""

from omnirl.rewards.jpeg import JpegCompressibility


class ConstantOnFlaggedRows:
    def __init__(self):
        self.jpeg = JpegCompressibility()

    def __call__(self, images, prompts, metadata):
        scores = self.jpeg(images, prompts, metadata)
        return [0.0 if m.get("constant") else s for s, m in zip(scores, metadata)]
