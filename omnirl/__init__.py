"""omnirl: PyTorch-native RL post-training for diffusion and omni-modal models."""
