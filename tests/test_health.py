"""The run's self-checks (omnirl.health): the LoRA proof, the parity gate, the sample statistics, the
alerts and what they do; and, on the tiny SD3, the quickstart recipe's collapse alerting in the run's first
half while a reward that cannot be gamed that way does not alert."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from omnirl.errors import ConfigError
from omnirl.health import lora as L
from omnirl.health import monitors as M
from omnirl.health.alerts import Alerts
from omnirl.metrics import read_metrics
from omnirl.recipe import config_for

ROOT = Path(__file__).resolve().parent.parent
SMALL_RUN = [
    "--rollout.prompts_per_step", "1", "--rollout.group_size", "2", "--sampling.num_steps", "2",
    "--log.image_every", "0", "--log.no-tensorboard", "--checkpoint.every", "0",
]  # fmt: skip


def train_main(argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("omnirl_train_script", ROOT / "scripts/train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def one_error_line(capsys, status: int, expected: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and expected in lines[0], err[-3000:]
    assert status == (2 if "lora.target_modules" in expected else 1)
    return lines[0]


# ---- LoRA proof -------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_a_target_that_binds_nothing_is_one_error_line(tiny_sd3, tmp_path, capsys, monkeypatch):
    """peft accepts a target list of which one entry binds nothing (`to_outt.0`, a typo of `to_out.0`)."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    args = ["--model.path", str(tiny_sd3), "--run.output_dir", str(out), *SMALL_RUN]
    targets = ["--lora.target_modules", "to_q", "to_outt.0"]
    status = train_main(["--recipe", "sd3_tiny_flowgrpo", *args, *targets])
    line = one_error_line(capsys, status, "lora.target_modules: 'to_outt.0' matches no module")
    assert "'sd3'" in line
    assert not (out / "metrics.jsonl").exists()  # before the first step
    status = train_main(["--recipe", "sd3_tiny_flowgrpo", *args, "--lora.target_modules", "to_nothing"])
    one_error_line(
        capsys, status, "lora.target_modules ['to_nothing'] bind no module of the SD3Transformer2DModel"
    )


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_a_stream_left_without_lora_is_one_error_line(tiny_ltx2, tmp_path, capsys, monkeypatch):
    """LTX-2: `attn1.to_q` binds the video stream's self-attention only (the audio one is `audio_attn1`)."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    args = ["--model.path", str(tiny_ltx2), "--run.output_dir", str(out), "--lora.target_modules"]
    status = train_main(["--recipe", "ltx23_tiny_t2av_flowgrpo", *args, "attn1.to_q"])
    one_error_line(capsys, status, "lora.target_modules ['attn1.to_q'] bind no module of the audio stream")
    assert not (out / "metrics.jsonl").exists()


def test_an_expert_left_without_lora_is_refused():
    """Two experts (Wan 2.2 A14B's layout) of which the LoRA bound only the first."""
    cfg = config_for("sd3")
    cfg.lora.target_modules = ["to_q"]

    def expert(name: str) -> nn.Module:
        m = nn.Module()
        m.attn = nn.Module()
        m.attn.add_module(name, nn.Linear(4, 4))
        return m

    first = inject_adapter_in_model(LoraConfig(r=2, target_modules=["to_q"]), expert("to_q"))
    second = expert("query")  # another layout: nothing called to_q, so no LoRA
    counts = L.census(cfg, {"transformer": first, "transformer_2": second})
    assert counts["experts"] == {"transformer": 1, "transformer_2": 0}
    with pytest.raises(ConfigError, match="bind no module of the expert 'transformer_2'"):
        L.check_census(cfg, counts)
    L.check_census(cfg, L.census(cfg, {"transformer": first}))  # one expert, bound: passes


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_an_update_that_does_not_reach_the_rollout_stops(tiny_sd3, tmp_path, capsys, monkeypatch):
    """An optimizer whose step writes nothing into the module the rollout runs."""
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, closure=None: None)
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    args = ["--model.path", str(tiny_sd3), "--run.output_dir", str(out), "--run.steps", "3", *SMALL_RUN]
    status = train_main(["--recipe", "sd3_tiny_flowgrpo", *args])
    one_error_line(capsys, status, "step 0: the first optimizer step left the rollout's module unchanged")
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0]


# ---- the parity gate ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_the_parity_gate_stops_a_perturbed_rollout(tiny_sd3, tmp_path, capsys, monkeypatch):
    """A rollout whose recorded log-probs are off by 0.01 at timestep index 0 (a rollout that samples
    another policy than the trainer's) stops at the first update; the unperturbed run logs its gap."""
    from omnirl.ops.diffusion import DiffusionOps

    generate = DiffusionOps.generate

    def perturbed(self, requests, on_done):
        trajs = generate(self, requests, on_done)
        for t in trajs:
            t.logprobs = t.logprobs + 0.01 * (t.step_indices == 0)
        return trajs

    monkeypatch.chdir(ROOT)
    args = ["--model.path", str(tiny_sd3), "--run.steps", "2", *SMALL_RUN]
    status = train_main(["--recipe", "sd3_tiny_flowgrpo", *args, "--run.output_dir", str(tmp_path / "a")])
    assert status == 0, capsys.readouterr().err[-2000:]
    rows = read_metrics(tmp_path / "a/metrics.jsonl")
    assert all(r["health/parity_gap"] <= 1e-5 for r in rows), rows
    monkeypatch.setattr(DiffusionOps, "generate", perturbed)
    status = train_main(["--recipe", "sd3_tiny_flowgrpo", *args, "--run.output_dir", str(tmp_path / "b")])
    line = one_error_line(capsys, status, "step 0: parity gate: sd3 stream latent, timestep index 0:")
    assert "past the fp32 tolerance 0.001" in line
    assert read_metrics(tmp_path / "b/metrics.jsonl")[0]["health/parity_gap"] == pytest.approx(0.01, rel=1e-3)


# ---- sample statistics and alerts --------------------------------------------------------------------


def test_image_statistics_by_hand():
    black = torch.zeros(3, 16, 16)
    s = M.image_stats(black)
    assert s["dark_frac"] == 1 and s["saturated_frac"] == 1 and s["colour_entropy"] == 0
    assert s["high_freq_energy"] == 0
    checker = (torch.arange(16).view(-1, 1) + torch.arange(16).view(1, -1)) % 2  # the highest frequency
    s = M.image_stats(checker.float().expand(3, 16, 16) * 0.5 + 0.25)
    assert s["dark_frac"] == 0 and s["saturated_frac"] == 0 and s["colour_entropy"] == pytest.approx(1.0)
    assert s["high_freq_energy"] == pytest.approx(1.0)


def test_group_diversity_repetition_and_audio():
    class T:
        def __init__(self, group, image=None, ids=None):
            from omnirl.models.base import Output

            self.request = type("R", (), {"group_id": group})()
            self.output = Output(image=image)
            if ids is not None:
                self.response_ids = torch.tensor(ids)

    same = [T(0, torch.full((3, 4, 4), 0.5)) for _ in range(3)]
    apart = [T(1, torch.zeros(3, 4, 4)), T(1, torch.ones(3, 4, 4))]
    sums = M.step_sums(same + apart)
    assert sums["diversity_count"] == 2 and sums["diversity_sum"] == pytest.approx(0 + 1)
    nan = [T(2, torch.full((3, 4, 4), float("nan"))), T(2, torch.zeros(3, 4, 4))]
    assert M.step_sums(same + apart + nan) == M.step_sums(same + apart + nan[1:])  # a NaN sample: none
    text = M.step_sums([T(0, ids=[1, 2, 3, 1, 2, 3, 1, 2, 3]), T(0, ids=[4, 5])])
    assert text["repetition_sum"] == pytest.approx(4 / 7)  # 7 3-grams, 3 distinct
    assert text["diversity_sum"] == pytest.approx(1.0)  # no token in common
    quiet = M.audio_stats(torch.cat([torch.zeros(1, 800), 0.5 * torch.ones(1, 800)], dim=1), 8000)
    assert quiet["silence_frac"] == 0.5
    assert quiet["loudness_dbfs"] == pytest.approx(20 * math.log10(0.5 / math.sqrt(2)))


def test_alerts_need_patience_and_adapt_moves_the_kl_weight():
    cfg = config_for("sd3")
    cfg.health.on_alert = "adapt"
    alerts = Alerts(cfg)
    ratios = [1.0, 0.45, 0.4, 0.3, 0.7, 0.8, 0.9]
    raised, betas = [], []
    for step, r in enumerate(ratios):
        raised += [a.step for a in alerts.observe(step, {"health/diversity_ratio": r})]
        cfg.algo.kl_beta = alerts.adapt({"health/diversity_ratio": r})
        betas.append(cfg.algo.kl_beta)
    assert raised == [2]  # two steps below 0.5 (health.patience 2): one alert
    assert betas[0] == 0 and betas[1] == cfg.health.adapt_kl_init
    assert betas[1] < betas[2] < betas[3]  # raised while diversity falls
    assert betas[4] < betas[3] and betas[-1] < betas[4]  # relaxed once it recovers
    assert alerts.history[0].line() == (
        "health: step 2: health/diversity_ratio 0.4 below its threshold 0.5 (health.on_alert: adapt)"
    )


def test_adapt_acts_on_a_fall_before_it_crosses_the_target():
    """The KL weight set at a step shapes the next update: a ratio falling fast toward the threshold starts
    the KL while still above the controller's target (0.55); one resting there does not."""
    cfg = config_for("sd3")
    cfg.health.on_alert = "adapt"
    falling, resting = Alerts(cfg), Alerts(cfg)
    betas = [falling.adapt({"health/diversity_ratio": r}) for r in (0.9, 0.75, 0.62)]
    assert betas == [0.0, 0.0, cfg.health.adapt_kl_init]  # 0.62 falling by 0.13 a step: 0.49 next
    assert [resting.adapt({"health/diversity_ratio": r}) for r in (0.62, 0.62, 0.6)] == [0.0, 0.0, 0.0]


class Ops:
    """What Health reads of the trainer's ops: a policy holding a LoRA on `to_q`."""

    def __init__(self):
        policy = nn.Module()
        policy.to_q = nn.Linear(4, 4)
        self.policy = inject_adapter_in_model(LoraConfig(r=2, target_modules=["to_q"]), policy)
        self.adapter = object()


def test_adapt_sets_the_weight_of_the_update_after_the_samples_that_fall():
    """Health.before_update reads the step's samples and sets the KL weight that step's update uses: a
    group whose spread halves after the baseline steps gets the KL in the same step, logged as such."""
    from omnirl.health import Health
    from omnirl.models.base import Output

    class T:
        def __init__(self, spread):
            self.request = type("R", (), {"group_id": 0})()
            self.output = Output(image=torch.full((3, 4, 4), 0.5 + spread))

    cfg = config_for("qwen3_omni_thinker")
    cfg.lora.target_modules, cfg.health.on_alert = ["to_q"], "adapt"
    health = Health(cfg, Ops(), None, None)
    used, logged = [], []
    for step, spread in enumerate([0.4, 0.4, 0.4, 0.4, 0.2]):
        trajs = [T(-spread), T(spread)]
        health.before_update(step, trajs)
        used.append(cfg.algo.kl_beta)  # what this step's update reads
        out = health.after_step(step, {"train/updates": 1.0, "reward/mean": 0.0}, trajs, None, lambda: None)
        logged.append(out["health/kl_beta"])
    assert out["health/diversity_ratio"] == pytest.approx(0.5)
    assert used == [0.0, 0.0, 0.0, 0.0, cfg.health.adapt_kl_init] and logged == used


def test_bad_health_values_are_refused(tmp_path):
    from omnirl.recipe import load_config

    base = ["--model.path", str(tmp_path), "--run.output_dir", str(tmp_path / "o")]
    with pytest.raises(ConfigError, match="health.guard_every > 0 needs health.guard_prompts"):
        load_config("sd3_tiny_flowgrpo", [*base, "--health.guard_every", "5"])
    with pytest.raises(ConfigError, match="health.diversity_min must be a number in"):
        load_config("sd3_tiny_flowgrpo", [*base, "--health.diversity_min", "1.5"])


# ---- the quickstart collapses; an ungameable reward does not alert ------------------------------------


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_the_quickstart_alerts_in_its_first_half(tiny_sd3, tmp_path, capsys, monkeypatch):
    """The quickstart recipe as it ships (200 steps, JPEG compressibility), on one process instead of two
    (the same samples: seeds never depend on the rank) and with health.on_alert stop, so that the run ends
    at its first alert instead of running its 200 steps: the diversity alert comes before step 100."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    args = ["--model.path", str(tiny_sd3), "--run.output_dir", str(out), "--health.on_alert", "stop"]
    status = train_main(["--recipe", "sd3_tiny_flowgrpo", *args, "--log.image_every", "0"])
    line = one_error_line(capsys, status, "health/diversity_ratio")
    step = int(line.split("health: step ")[1].split(":")[0])
    assert step < 100, line
    alerts = [json.loads(x) for x in open(out / "health_alerts.jsonl")]
    assert alerts[0]["metric"] == "health/diversity_ratio" and alerts[0]["step"] == step
    assert (out / "checkpoints").is_dir()  # stop saves the step first


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_an_ungameable_reward_does_not_alert(tiny_sd3, tmp_path, capsys, monkeypatch):
    """JPEG incompressibility (detail is rewarded: no sample collapse pays) over more steps than the
    quickstart needs to alert (step 46): no alert."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    args = ["--model.path", str(tiny_sd3), "--run.output_dir", str(out), "--health.on_alert", "stop"]
    recipe = yaml.safe_load((ROOT / "yaml/sd3_tiny_flowgrpo.yaml").read_text())
    recipe["reward"]["weights"] = {"jpeg_incompressibility": 1.0}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    status = train_main(
        ["--recipe", str(tmp_path / "recipe.yaml"), *args, "--run.steps", "50", "--log.image_every", "0"]
    )
    assert status == 0, capsys.readouterr().err[-2000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 50 and rows[-1]["health/alerts"] == 0
    assert min(r["health/diversity_ratio"] for r in rows[3:]) > 0.5  # health.diversity_min
    assert not (out / "health_alerts.jsonl").read_text()
