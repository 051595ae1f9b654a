"""Checkpoints, export, and the trainer's failure behaviour, on the tiny SD3.

A checkpoint of another model, a damaged or crafted one and a broken meta.json are refused before
anything is loaded (on resume, on loading and on export); an export loads in diffusers and peft and
merges; a non-finite loss or sample is skipped or stops the run. Exact resume under torchrun:
test_checkpoint_resume.py.
"""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import torch.distributed.checkpoint as dcp
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
from safetensors.torch import load_file, save_file

from omnirl import checkpoint
from omnirl import distributed as D
from omnirl.batching import make_requests
from omnirl.checkpoint import CheckpointError
from omnirl.data.prompts import load_prompts
from omnirl.models import get_adapter
from omnirl.models.base import Request
from omnirl.ops.diffusion import DiffusionOps, sampling_params
from omnirl.step import NonFiniteError, update
from tests.support_compare import max_diff
from tests.test_sd3 import make_requests as sd3_requests
from tests.test_sd3 import noise_free, run_pipeline
from tests.test_train import ROOT, tiny_cfg

# The LoRA of the `adapter` fixture, and so of every checkpoint these tests save and resume.
ADAPTER_LORA = ("--lora.rank", "4", "--lora.alpha", "8")


@pytest.fixture(scope="module")
def adapter(tiny_sd3):
    """LoRA rank 4, alpha 8 (alpha != rank: every export must carry the scale), with a non-zero B."""
    cfg = tiny_cfg(tiny_sd3, Path("unused"), *ADAPTER_LORA)
    D.seed_everything(0)
    adapter = get_adapter("sd3")(cfg, torch.device("cpu"))
    for name, p in adapter.policy.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0.0, 0.05)
    return adapter


def adapter_cfg(tiny_sd3, out: Path):
    """The config of a run of the `adapter` fixture's LoRA whose run.output_dir is `out` itself."""
    cfg = tiny_cfg(tiny_sd3, out, *ADAPTER_LORA)
    cfg.run.output_dir = str(out)
    return cfg


def save_checkpoint(adapter, tiny_sd3, out: Path) -> Path:
    """The `adapter` fixture saved as the step-3 checkpoint of a run into `out`, with a fresh optimizer."""
    for p in adapter.trainable_parameters():
        p.grad = None  # left by an earlier test, a gradient keeps DCP from initialising the optimizer state
    opt = torch.optim.AdamW(adapter.trainable_parameters(), lr=1e-2)
    return checkpoint.save(adapter_cfg(tiny_sd3, out), 3, adapter.policy, opt, D.init_distributed())


@pytest.fixture
def saved(adapter, tiny_sd3, tmp_path) -> Path:
    """The `adapter` fixture's checkpoint, saved into tmp_path/out by save_checkpoint."""
    return save_checkpoint(adapter, tiny_sd3, tmp_path / "out")


def reseal(path: Path) -> None:
    """Rewrite a checkpoint's manifest to the files as they are now: the checkpoint a run (or anyone who
    can write the directory) could have written this way."""
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    for rel in manifest["files"]:
        f = path / rel
        manifest["files"][rel] = {"size": f.stat().st_size, "xxh3_128": checkpoint.file_hash(f)}
    (path / checkpoint.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.slow
def test_checkpoint_of_another_model_fails_before_loading(adapter, tiny_sd3, tmp_path):
    path = save_checkpoint(adapter, tiny_sd3, tmp_path / "out")
    # The RNG states come back on resume.
    expected = torch.rand(3)

    cfg8 = tiny_cfg(tiny_sd3, tmp_path / "other", "--checkpoint.resume", str(path))
    with pytest.raises(
        CheckpointError,
        match=r"lora\.alpha: checkpoint 8\.0, this run 16\.0; lora\.rank: checkpoint 4, this run 8",
    ):
        checkpoint.find_resume(cfg8)
    # Loading into such a model fails as well, and leaves its weights and optimizer untouched.
    other = get_adapter("sd3")(cfg8, torch.device("cpu"))
    before = {k: v.clone() for k, v in other.policy.state_dict().items()}
    opt = torch.optim.AdamW(other.trainable_parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match="lora.rank"):
        checkpoint.load(path, cfg8, other.policy, opt, D.init_distributed())
    # meta.json edited to match: the tensors themselves are checked before anything is read.
    meta = json.loads((path / "meta.json").read_text())
    meta["identity"] = checkpoint.identity(cfg8)
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(
        CheckpointError, match=r"do not fit this model.*lora_A.*checkpoint \(4, 64\), model \(8, 64\)"
    ):
        checkpoint.load(path, cfg8, other.policy, opt, D.init_distributed())
    assert all(torch.equal(v, before[k]) for k, v in other.policy.state_dict().items())
    assert not opt.state

    reseal(path)  # as if it had been written so: only its identity is wrong now
    other_model = tiny_cfg(
        tiny_sd3, tmp_path / "x", "--model.path", str(tmp_path), "--checkpoint.resume", str(path)
    )
    with pytest.raises(CheckpointError, match=f"model.path: checkpoint '{tiny_sd3}', this run '{tmp_path}'"):
        checkpoint.find_resume(other_model)

    # The matching run loads it, RNG included; a fresh start over existing checkpoints is refused.
    meta["identity"] = checkpoint.identity(tiny_cfg(tiny_sd3, tmp_path, *ADAPTER_LORA))
    (path / "meta.json").write_text(json.dumps(meta))
    cfg4 = adapter_cfg(tiny_sd3, tmp_path / "out")
    torch.rand(5)
    opt = torch.optim.AdamW(adapter.trainable_parameters(), lr=1e-2)
    assert checkpoint.load(path, cfg4, adapter.policy, opt, D.init_distributed())[0] == 3
    assert torch.equal(torch.rand(3), expected)
    cfg4.checkpoint.resume = ""
    with pytest.raises(CheckpointError, match="holds checkpoints after step 0 .step_000003."):
        checkpoint.find_resume(cfg4)


def one_group_cfg(tiny_sd3, tmp_path):
    """One prompt, a group of two samples, two denoising steps: the smallest step that has advantages."""
    return tiny_cfg(
        tiny_sd3, tmp_path, "--rollout.prompts_per_step", "1", "--rollout.group_size", "2",
        "--sampling.num_steps", "2",
    )  # fmt: skip


@pytest.mark.slow
def test_nonfinite_loss_is_skipped_or_stops(adapter, tiny_sd3, tmp_path):
    cfg = one_group_cfg(tiny_sd3, tmp_path)
    dist = D.init_distributed()
    requests, _ = make_requests(cfg, load_prompts(cfg.data.train_path), 0, dist, sampling_params(cfg))
    trajs = adapter.rollout(requests)
    for t, a in zip(trajs, (1.0, -1.0)):
        t.reward, t.advantage = a, a  # scored (an unscored sample is a non-finite one)
    keep = torch.tensor([True, True])
    good = float(trajs[0].logprobs[0])
    trajs[0].logprobs[0] = float("nan")  # a NaN behaviour log-prob: NaN ratio, loss and gradients
    model = adapter.policy
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(adapter.trainable_parameters(), lr=1e-2)
    ops = DiffusionOps(cfg, adapter)

    logs = update(cfg, ops, opt, trajs, keep, 7)
    assert logs["train/skipped_nonfinite"] == 1 and "train/updates" not in logs and "loss/policy" not in logs
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not opt.state and all(p.grad is None for p in adapter.trainable_parameters())

    cfg.train.on_nonfinite = "stop"
    with pytest.raises(NonFiniteError, match="step 7: non-finite loss and gradient norm"):
        update(cfg, ops, opt, trajs, keep, 7)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    trajs[0].logprobs[0] = good  # finite again: the same update goes through
    logs = update(cfg, ops, opt, trajs, keep, 7)
    assert logs["train/skipped_nonfinite"] == 0 and logs["train/updates"] == 1
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


class CountingReward:
    """JPEG compressibility, counting the images it was asked to score."""

    modality = "image"

    def __init__(self):
        from omnirl.rewards.jpeg import JpegCompressibility

        self.jpeg, self.seen = JpegCompressibility(), 0

    def __call__(self, images, prompts, metadata):
        self.seen += len(images)
        return self.jpeg(images, prompts, metadata)


@pytest.mark.slow
def test_nonfinite_samples_are_never_scored_and_skip_or_stop(tiny_sd3, tmp_path):
    """A policy with a NaN weight makes NaN latents and images: they are not scored (a NaN image would be
    scored as a black one). Some NaN samples in a step: its update is skipped and counted
    (train.on_nonfinite skip), or the run stops naming the step (stop). All of them: the run stops either
    way, since the policy that made them is not updated and would make them again."""
    from omnirl.rewards.pool import RewardPool
    from omnirl.scoring import nonfinite_parts, rollout_and_score
    from omnirl.step import assign_advantages

    cfg = one_group_cfg(tiny_sd3, tmp_path)
    D.seed_everything(0)
    adapter = get_adapter("sd3")(cfg, torch.device("cpu"))
    ops = DiffusionOps(cfg, adapter)
    requests, _ = make_requests(cfg, load_prompts(cfg.data.train_path), 0, D.init_distributed(), ops.params)
    counting = CountingReward()
    pool = RewardPool.from_instances({"counting": (counting, 1.0)}, 1, 60)
    finite, _ = rollout_and_score(ops, pool, requests)
    assert counting.seen == 2 and not any(nonfinite_parts(t) for t in finite)

    name, param = next((n, p) for n, p in adapter.policy.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        param[0, 0] = float("nan")
    stats: dict[str, float] = {}
    trajs, per_reward = rollout_and_score(ops, pool, requests, stats)
    pool.close()
    assert counting.seen == 2, "a NaN sample was scored"
    assert all(math.isnan(t.reward) for t in trajs) and per_reward == {"counting": pytest.approx([])}
    # Of 2 steps only the first is trained (every step but the last): its input, the initial noise, is finite.
    assert {"next_latents", "final_latents", "output.image"} <= set(nonfinite_parts(trajs[0]))
    keep, metrics = assign_advantages(cfg, trajs)
    assert not keep.any() and math.isnan(metrics["reward/mean"]) and metrics["adv/groups"] == 0
    before = {k: v.clone() for k, v in adapter.policy.state_dict().items()}
    opt = torch.optim.AdamW(adapter.trainable_parameters(), lr=1e-2)
    expected = r"step 4: all 2 samples hold NaN or infinity; on this rank request 0: .*output\.image"
    with pytest.raises(NonFiniteError, match=expected + ".*: the policy makes no finite sample"):
        update(cfg, ops, opt, trajs, keep, 4)
    mixed = [finite[0], trajs[1]]  # request 0's sample finite, request 1's NaN
    keep, _ = assign_advantages(cfg, mixed)
    logs = update(cfg, ops, opt, mixed, keep, 4)
    assert logs["train/skipped_nonfinite"] == 1 and logs["rollout/nonfinite_samples"] == 1
    assert "train/updates" not in logs and not opt.state
    for k, v in adapter.policy.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, equal_nan=True)  # not updated
    cfg.train.on_nonfinite = "stop"
    expected = r"step 4: 1 samples hold NaN or infinity, so none of them was scored; on this rank request 1: "
    with pytest.raises(NonFiniteError, match=expected + r".*output\.image.*train\.on_nonfinite: stop"):
        update(cfg, ops, opt, mixed, keep, 4)


def test_nonfinite_parts_of_every_kind_of_sample():
    """Token log-probs (an omni model's logits), video and audio outputs are checked like latents."""
    from omnirl.models.base import GenerationParams, OmniTrajectory, Output, Trajectory
    from omnirl.scoring import nonfinite_parts

    request = Request("p", 0, 0, 0, GenerationParams(max_new_tokens=4))
    ids = torch.tensor([1, 2])
    omni = OmniTrajectory(request, ids, ids, torch.tensor([-0.5, float("nan")]), {}, "stop", "text")
    assert nonfinite_parts(omni) == ["logprobs"]
    omni.logprobs[1] = -1.0
    assert nonfinite_parts(omni) == []
    z = torch.zeros(1, 4)
    video = torch.zeros(2, 3, 4, 4)
    video[1, 0, 0, 0] = float("inf")
    audio = torch.zeros(1, 8)
    audio[0, 3] = float("nan")
    output = Output(video=video, fps=8.0, audio=audio, sample_rate=16000)
    traj = Trajectory(
        request, z, z, torch.zeros(1, dtype=torch.long), torch.zeros(1), torch.ones(2), {}, output, z[0]
    )
    assert nonfinite_parts(traj) == ["output.video", "output.audio"]


def export_status(*args: str) -> int:
    """scripts/export.py's main on these arguments, run in this process: its exit status."""
    spec = importlib.util.spec_from_file_location("export_script", ROOT / "scripts/export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main([str(a) for a in args])


def run_export(*args: str) -> None:
    assert export_status(*args) == 0


@pytest.mark.slow
def test_export_loads_in_diffusers_and_peft_and_merges(saved, adapter, tiny_sd3, tmp_path):
    path = saved
    run_export(path, tmp_path / "diffusers")
    run_export(path, tmp_path / "peft", "--format", "peft")
    run_export(path, tmp_path / "merged", "--merge")
    run_export(tmp_path / "diffusers", tmp_path / "peft_from_lora", "--format", "peft")  # a run's lora/ dir

    requests = sd3_requests(noise_free(), n=2)
    ours = torch.stack([t.final_latents for t in adapter.rollout(requests)])  # omnirl's own output
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    pipe.set_progress_bar_config(disable=True)
    base = run_pipeline(pipe, adapter, requests, "latent")
    assert max_diff(base, ours) > 1e-2  # the LoRA changes the output: the comparisons below can fail

    pipe.load_lora_weights(tmp_path / "diffusers")
    assert max_diff(run_pipeline(pipe, adapter, requests, "latent"), ours) < 1e-5
    pipe.unload_lora_weights()

    transformer = SD3Transformer2DModel.from_pretrained(tiny_sd3, subfolder="transformer")
    peft_model = peft.PeftModel.from_pretrained(transformer, tmp_path / "peft")
    assert peft_model.peft_config["default"].lora_alpha == 8 and peft_model.peft_config["default"].r == 4
    pipe.transformer = peft_model.get_base_model()  # peft injected the LoRA into it in place
    assert max_diff(run_pipeline(pipe, adapter, requests, "latent"), ours) < 1e-5
    # From a run's lora/ directory: the same adapter (only the base model's name is unknown there).
    name = "adapter_model.safetensors"
    assert (tmp_path / "peft" / name).read_bytes() == (tmp_path / "peft_from_lora" / name).read_bytes()
    configs = [
        json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("peft", "peft_from_lora")
    ]
    assert configs[0].pop("base_model_name_or_path") == str(tiny_sd3)
    assert configs[1].pop("base_model_name_or_path") is None and configs[0] == configs[1]

    merged = StableDiffusion3Pipeline.from_pretrained(tmp_path / "merged")
    merged.set_progress_bar_config(disable=True)
    assert max_diff(run_pipeline(merged, adapter, requests, "latent"), ours) < 1e-5
    # The merged weights are base + (alpha / r) B A; untargeted weights are the base's.
    lora = load_file(tmp_path / "diffusers/pytorch_lora_weights.safetensors")
    base_sd = SD3Transformer2DModel.from_pretrained(tiny_sd3, subfolder="transformer").state_dict()
    merged_sd = merged.transformer.state_dict()
    targeted = {k.removeprefix("transformer.").removesuffix(".lora_A.weight") for k in lora if "lora_A" in k}
    for key, w in base_sd.items():
        module = key.rsplit(".", 1)[0]
        if module in targeted and key.endswith("weight"):
            a, b = lora[f"transformer.{module}.lora_A.weight"], lora[f"transformer.{module}.lora_B.weight"]
            torch.testing.assert_close(merged_sd[key], w + 2.0 * b @ a, atol=1e-6, rtol=0)
        else:
            assert torch.equal(merged_sd[key], w), key
    assert list((tmp_path / "merged/transformer").glob("*.safetensors"))


@pytest.mark.slow
def test_export_merges_a_full_finetune(tiny_sd3, tmp_path):
    cfg = tiny_cfg(tiny_sd3, tmp_path, "--model.finetune", "full")
    cfg.run.output_dir = str(tmp_path / "out")
    adapter = get_adapter("sd3")(cfg, torch.device("cpu"))
    with torch.no_grad():
        adapter.policy.proj_out.weight.add_(0.5)  # "trained"
    opt = torch.optim.AdamW(adapter.trainable_parameters())
    path = checkpoint.save(cfg, 1, adapter.policy, opt, D.init_distributed())
    with pytest.raises(SystemExit):  # no LoRA to export
        run_export(path, tmp_path / "lora")
    run_export(path, tmp_path / "merged", "--merge", "--dtype", "bfloat16")
    merged = SD3Transformer2DModel.from_pretrained(tmp_path / "merged", subfolder="transformer")
    trained = adapter.policy.state_dict()
    assert all(torch.equal(v, trained[k].bfloat16().float()) for k, v in merged.state_dict().items())


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.replace("\r", "\n").splitlines() if line.startswith("error: ")]


def resume_cfg(tiny_sd3, path: Path, out: Path):
    return tiny_cfg(tiny_sd3, out, *ADAPTER_LORA, "--checkpoint.resume", str(path))


@pytest.mark.slow
def test_flipped_byte_in_a_shard_is_found_before_loading(saved, tiny_sd3, tmp_path, capsys):
    path = saved
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())["files"]
    assert {"meta.json", "metrics.jsonl", "model_optim/.metadata", "rng/rank_00000.pt"} <= manifest.keys()
    (shard,) = [k for k in manifest if k.endswith(".distcp")]
    checkpoint.find_resume(resume_cfg(tiny_sd3, path, tmp_path / "run"))  # intact: accepted
    f = path / shard
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=rf"is damaged.*{shard}: its content changed after it was written"
    ):
        checkpoint.find_resume(resume_cfg(tiny_sd3, path, tmp_path / "run"))
    f.write_bytes(bytes(data[:-10]))  # truncated
    with pytest.raises(
        CheckpointError, match=rf"{shard}: {len(data) - 10} bytes, the manifest says {len(data)}"
    ):
        checkpoint.find_resume(resume_cfg(tiny_sd3, path, tmp_path / "run"))
    assert export_status(path, tmp_path / "lora") == 2
    err = capsys.readouterr().err
    assert error_lines(err) == [err.strip()] and shard in err
    assert not (tmp_path / "lora").exists()
    (path / checkpoint.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint .no manifest.json"):
        checkpoint.find_resume(resume_cfg(tiny_sd3, path, tmp_path / "run"))


@pytest.mark.slow
def test_nan_bytes_in_a_tensor_are_refused_on_resume_and_export(saved, adapter, tiny_sd3, tmp_path, capsys):
    """64 NaN bytes over one LoRA tensor's data: the manifest catches it; with a manifest written over the
    damaged files (the damage came first), the finite check after loading names the tensor."""
    path = saved
    name, tensor = next((n, p) for n, p in adapter.policy.named_parameters() if "lora_B" in n)
    (shard,) = (path / "model_optim").glob("*.distcp")
    data = shard.read_bytes()
    at = data.find(tensor.detach().numpy().tobytes())  # DCP stores each tensor's bytes as they are
    assert at > 0
    nan = np.full(16, np.nan, dtype=np.float32).tobytes()  # 64 bytes
    shard.write_bytes(data[:at] + nan + data[at + len(nan) :])
    with pytest.raises(CheckpointError, match="is damaged"):
        checkpoint.find_resume(resume_cfg(tiny_sd3, path, tmp_path / "run"))
    reseal(path)
    cfg = resume_cfg(tiny_sd3, path, tmp_path / "run")
    assert checkpoint.find_resume(cfg) == path
    other = get_adapter("sd3")(cfg, torch.device("cpu"))
    opt = torch.optim.AdamW(other.trainable_parameters(), lr=1e-2)
    with pytest.raises(
        CheckpointError, match=rf"1 trained tensors hold NaN or infinity, e.g. model\.{re.escape(name)}"
    ):
        checkpoint.load(path, cfg, other.policy, opt, D.init_distributed())
    assert export_status(path, tmp_path / "lora") == 2
    (err,) = error_lines(capsys.readouterr().err)  # after the progress bars of loading the base model
    assert "hold NaN or infinity" in err and name in err
    assert not (tmp_path / "lora").exists()
    # A LoRA directory with NaNs in it is refused as well.
    lora = tmp_path / "nan_lora"
    adapter.export_lora(lora)
    weights = load_file(lora / checkpoint.LORA_FILE)
    key = sorted(weights)[0]
    weights[key][0] = float("nan")
    save_file(weights, lora / checkpoint.LORA_FILE)
    assert export_status(lora, tmp_path / "peft", "--format", "peft") == 2
    assert key in capsys.readouterr().err and not (tmp_path / "peft").exists()


class RunsCommand:
    """Unpickling this runs a shell command (touch a file), as a crafted checkpoint would."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_metadata_fails_to_load_and_runs_nothing(saved, adapter, tiny_sd3, tmp_path, capsys):
    """DCP's .metadata is a pickle: one whose reduce calls os.system, with a matching manifest (whoever
    crafts a checkpoint can write its manifest too), fails to load and the command never runs: on resume,
    on loading and on export. A non-tensor item of a shard (read by torch.load) is held to plain data."""
    import pickle

    path = saved
    marker = tmp_path / "ran"
    metadata = path / "model_optim/.metadata"
    genuine = metadata.read_bytes()
    metadata.write_bytes(pickle.dumps(RunsCommand(marker)))
    reseal(path)
    cfg = resume_cfg(tiny_sd3, path, tmp_path / "run")
    expected = r"\.metadata: not checkpoint metadata, so nothing was loaded \(posix\.system is not a class of"
    with pytest.raises(CheckpointError, match=expected):
        checkpoint.find_resume(cfg)
    opt = torch.optim.AdamW(adapter.trainable_parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match=expected):
        checkpoint.load(path, cfg, adapter.policy, opt, D.init_distributed())
    assert export_status(path, tmp_path / "lora") == 2
    assert "not checkpoint metadata" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "lora").exists()
    # A genuine Metadata object that carries a payload elsewhere in its pickle is refused too.
    metadata.write_bytes(genuine.replace(b"Metadata", b"Metadatx", 1))
    with pytest.raises(CheckpointError, match="not checkpoint metadata"):
        checkpoint.SafeReader(path / "model_optim").read_metadata()

    # The byte items of a shard (an optimizer's param groups) go through torch.load(weights_only=True).
    evil = tmp_path / "evil"
    dcp.save({"w": torch.ones(2), "extra": RunsCommand(marker)}, checkpoint_id=evil / "model_optim")
    with pytest.raises(CheckpointError, match=r"extra: not plain data.*the global posix\.system") as e:
        checkpoint.read_state(evil, {"w": torch.zeros(2), "extra": None})
    assert "weights_only" not in str(e.value)  # torch's advice to load it unrestricted is not repeated
    assert not marker.exists()


def test_broken_meta_json_is_a_checkpoint_error(saved, tiny_sd3, tmp_path):
    path = saved
    (path / "meta.json").write_text('{"format": 2, "step": ')
    reseal(path)
    with pytest.raises(CheckpointError, match=r"meta\.json: not valid JSON"):
        checkpoint.find_resume(resume_cfg(tiny_sd3, path, tmp_path / "run"))
    (path / "meta.json").write_text(json.dumps({"format": 2, "step": 3, "world_size": 0}))
    reseal(path)
    with pytest.raises(CheckpointError, match=r"meta\.json: 'run_name' must be a str"):
        checkpoint.find_resume(resume_cfg(tiny_sd3, path, tmp_path / "run"))


@pytest.mark.slow
def test_exported_lora_bytes_do_not_depend_on_the_hash_seed(saved, tmp_path):
    """peft keeps target_modules as a set, whose order changes with PYTHONHASHSEED; the exported files are
    written with it sorted, so identical runs give identical bytes (and checksums)."""
    path = saved
    # One process per hash seed, exporting both formats (peft's from the diffusers file, as a user would).
    script = (
        "import sys; sys.path.insert(0, 'scripts'); from export import main; a, b, c = sys.argv[1:]; "
        "assert main([a, b]) == 0 and main([b, c, '--format', 'peft']) == 0"
    )
    files = {}
    seeds = ("1", "2", "3", "4")  # two metadata keys in hash order: 4 processes agree by chance 1 in 8
    for pair in (seeds[:2], seeds[2:]):  # two processes at a time (their imports are most of their time)
        outs = {seed: [tmp_path / f"diffusers{seed}", tmp_path / f"peft{seed}"] for seed in pair}
        procs = {
            seed: subprocess.Popen(
                [sys.executable, "-c", script, str(path), *map(str, out)],
                cwd=ROOT,
                env={**os.environ, "PYTHONHASHSEED": seed},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for seed, out in outs.items()
        }
        for seed, proc in procs.items():
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            for fmt, d in zip(("diffusers", "peft"), outs[seed]):
                files[fmt, seed] = {p.name: p.read_bytes() for p in sorted(d.iterdir())}
    for fmt in ("diffusers", "peft"):
        assert all(files[fmt, seed] == files[fmt, "1"] for seed in seeds), fmt
    config = json.loads(files["peft", "1"]["adapter_config.json"])
    from omnirl.models.diffusers_setup import sort_safetensors_header

    lora = tmp_path / "diffusers1" / checkpoint.LORA_FILE
    before = load_file(lora)
    sort_safetensors_header(lora)  # already sorted: unchanged, and still a valid file
    assert lora.read_bytes() == files["diffusers", "1"][checkpoint.LORA_FILE]
    assert all(torch.equal(v, before[k]) for k, v in load_file(lora).items())
    assert config["target_modules"] == sorted(config["target_modules"])


class _Getattr:
    """Pickles as getattr(cls, name): how Python 3.11.0-3.11.4 pickle an enum member."""

    def __init__(self, cls, name):
        self.cls, self.name = cls, name

    def __reduce__(self):
        return (getattr, (self.cls, self.name))


def test_metadata_unpickler_resolves_enum_members_by_getattr_only():
    """DCP's metadata holds an enum (_MEM_FORMAT_ENCODING) that some Pythons pickle as getattr(class, name):
    that resolves, while getattr on anything else (a metadata class that is not an enum, an unknown name)
    is refused before it runs."""
    import io
    import pathlib
    import pickle

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from omnirl.checkpoint_checks import _MetadataUnpickler

    def load(obj):
        return _MetadataUnpickler(io.BytesIO(pickle.dumps(obj))).load()

    member = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    assert load(_Getattr(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")) is member
    for cls, name in ((pathlib.PosixPath, "unlink"), (_MEM_FORMAT_ENCODING, "__class__")):
        with pytest.raises(pickle.UnpicklingError, match="not an enum member of checkpoint metadata"):
            load(_Getattr(cls, name))
