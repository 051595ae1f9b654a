"""Rewards for trainer tests: a real reward, except rows flagged `constant`, which all score 0 (so their
groups have zero spread and are dropped)."""

from omnirl.rewards.jpeg import JpegCompressibility
from omnirl.rewards.mmk12 import Mmk12Reward


class ConstantOnFlaggedRows:
    modality = "image"

    def __init__(self):
        self.jpeg = JpegCompressibility()

    def __call__(self, images, prompts, metadata):
        scores = self.jpeg(images, prompts, metadata)
        return [0.0 if m.get("constant") else s for s, m in zip(scores, metadata)]


class Mmk12ZeroOnFlaggedRows:
    """The mmk12 reward (math-verify), except rows flagged `constant`, which all score 0."""

    modality = "text"

    def __init__(self):
        self.mmk12 = Mmk12Reward()

    def __call__(self, responses, prompts, metadata):
        scores = self.mmk12(responses, prompts, metadata)
        return [0.0 if m.get("constant") else s for s, m in zip(scores, metadata)]
