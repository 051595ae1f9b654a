"""The parity gate per place: LTX-2's video and audio streams apart, omni responses per span of token
positions. A rollout perturbed in one stream (one position) stops with one line naming that stream
(position); the unperturbed rollout passes."""

import json

import pytest
import torch

from omnirl.algos.correction import position_gaps, position_spans
from omnirl.health import parity as P
from omnirl.metrics import read_metrics
from omnirl.recipe import config_for
from tests.test_health import ROOT, SMALL_RUN, one_error_line, train_main


def test_position_spans_double_and_cover_every_position():
    assert position_spans(1) == [(0, 1)]
    assert position_spans(10) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 10)]
    covered = [p for lo, hi in position_spans(48) for p in range(lo, hi)]
    assert covered == list(range(48))


def test_position_gaps_by_hand():
    """Two responses of 5 and 3 tokens; position 3 (only the first reaches it) is off by 0.3."""
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    rollout = torch.zeros(8)
    actor = rollout.clone()
    actor[3] = 0.3
    actor[6] = -0.1  # the second response's position 1
    m = position_gaps(actor, rollout, positions, 6)
    assert m["consistency/pos0_0/logprob_abs_diff_mean"] == 0
    assert m["consistency/pos1_1/logprob_abs_diff_mean"] == pytest.approx(0.05)
    assert m["consistency/pos2_3/logprob_abs_diff_mean"] == pytest.approx(0.1)  # 3 tokens, one off by 0.3
    assert m["consistency/pos2_3/worst_position"] == 3
    assert m["consistency/pos2_3/worst_position_gap"] == pytest.approx(0.3)
    assert m["consistency/pos4_5/logprob_abs_diff_mean"] == 0 and "consistency/pos4_5/worst_position" in m
    assert not position_gaps(actor[:0], rollout[:0], positions[:0], 6)  # no tokens: nothing measured


def test_the_gate_names_the_worst_place():
    cfg = config_for("ltx2")
    streams = {
        "consistency/t01/logprob_abs_diff_mean": 4e-4,  # the pooled gap: under the tolerance
        "consistency/t01/video/logprob_abs_diff_mean": 1e-6,
        "consistency/t01/audio/logprob_abs_diff_mean": 2e-3,
        "consistency/t03/audio/logprob_abs_diff_mean": 1e-6,
    }
    with pytest.raises(P.ParityError, match=r"ltx2 stream audio, timestep index 1: .* by 0.002 on") as e:
        P.gate(cfg, 4, streams)
    assert str(e.value).startswith("step 4: parity gate:") and e.value.gap == 2e-3
    assert P.gate(cfg, 4, {**streams, "consistency/t01/audio/logprob_abs_diff_mean": 5e-4}) == {
        "health/parity_gap": 5e-4,
        "health/parity_tolerance": 1e-3,
    }
    cfg = config_for("qwen3_omni_thinker")
    cfg.model.dtype = "bfloat16"
    spans = {
        "consistency/logprob_abs_diff_mean": 0.01,
        "consistency/tokens": 40.0,
        "consistency/pos0_0/logprob_abs_diff_mean": 0.0,
        "consistency/pos0_0/worst_position": 0.0,
        "consistency/pos0_0/worst_position_gap": 0.0,
        "consistency/pos8_15/logprob_abs_diff_mean": 0.08,
        "consistency/pos8_15/worst_position": 11.0,
        "consistency/pos8_15/worst_position_gap": 0.4,
    }
    with pytest.raises(P.ParityError, match=r"response positions 8-15 \(the worst position 11: 0.4\): .* by "
                       r"0.08 on average, past the bf16 tolerance 0.05"):  # fmt: skip
        P.gate(cfg, 0, spans)
    with pytest.raises(P.ParityError, match=r"thinker response position 0: .* by nan on"):
        P.gate(cfg, 0, {**spans, "consistency/pos0_0/logprob_abs_diff_mean": float("nan")})
    assert P.gate(cfg, 0, {"loss/policy": 1.0}) == {}  # nothing measured: nothing to check


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_the_gate_names_the_perturbed_ltx2_stream(tiny_ltx2, tmp_path, capsys, monkeypatch):
    """LTX-2's rollout log-prob of the audio stream off by 0.01 at every trained step (the pooled log-prob
    off by the audio's share of it): the line names the audio stream, whose gap is measured apart from the
    video's; the unperturbed run logs both streams' gaps within 1e-5."""
    from omnirl.ops.diffusion import DiffusionOps

    generate = DiffusionOps.generate

    def perturbed(self, requests, on_done):
        trajs = generate(self, requests, on_done)
        audio = self.adapter.logprob_pool(self.params).weights[1]
        for t in trajs:
            t.stream_logprobs[:, 1] += 0.01
            t.logprobs = t.logprobs + 0.01 * audio
        return trajs

    monkeypatch.chdir(ROOT)
    args = ["--recipe", "ltx23_tiny_t2av_flowgrpo", "--model.path", str(tiny_ltx2), "--run.steps", "1"]
    args += [*SMALL_RUN[:4], *SMALL_RUN[6:]]  # the recipe's 6 steps: its SDE window takes 3
    status = train_main([*args, "--run.output_dir", str(tmp_path / "a")])
    assert status == 0, capsys.readouterr().err[-2000:]
    row = read_metrics(tmp_path / "a/metrics.jsonl")[0]
    per_stream = {k: v for k, v in row.items() if k.endswith("o/logprob_abs_diff_mean")}
    assert {k.split("/")[2] for k in per_stream} == {"video", "audio"}, row
    assert max(per_stream.values()) <= 1e-5 and row["health/parity_gap"] <= 1e-5
    monkeypatch.setattr(DiffusionOps, "generate", perturbed)
    status = train_main([*args, "--run.output_dir", str(tmp_path / "b")])
    line = one_error_line(capsys, status, "step 0: parity gate: ltx2 stream audio, timestep index")
    assert "by 0.01 on average, past the fp32 tolerance 0.001" in line
    row = read_metrics(tmp_path / "b/metrics.jsonl")[0]
    gaps = {k.split("/")[2]: v for k, v in row.items() if k.endswith("o/logprob_abs_diff_mean")}
    assert max(v for k, v in row.items() if "/video/" in k and k.endswith("_mean")) <= 1e-5
    assert min(v for k, v in row.items() if "/audio/" in k and k.endswith("_mean")) == pytest.approx(
        0.01, rel=1e-3
    )
    assert set(gaps) == {"video", "audio"}


@pytest.mark.slow
def test_the_gate_names_the_perturbed_omni_position(tiny_qwen3_omni_thinker_k12, tmp_path):
    """The omni rollout's log-prob of every response's token 5 off by 0.02: the gate names positions 4-7
    and position 5 in them; the mean over all tokens (under the tolerance) would have passed."""
    from omnirl.step import update
    from tests.test_omni_train import omni_cfg, signed_rollout

    cfg = omni_cfg(tiny_qwen3_omni_thinker_k12, tmp_path, "--optim.mini_batches", "1", "--algo.kl_beta", "0")
    adapter, ops, trajs, keep, _ = signed_rollout(cfg)
    recorded = [t.logprobs.clone() for t in trajs]
    opt = torch.optim.SGD(adapter.trainable_parameters(), lr=0.0)  # the policy stays the rollout's
    logs = update(cfg, ops, opt, trajs, keep, 0)
    assert P.gate(cfg, 0, logs)["health/parity_gap"] <= 1e-5
    assert any(k.startswith("consistency/pos4_7/") for k in logs), logs
    for t, lp in zip(trajs, recorded):
        t.logprobs = lp.clone()
        if len(lp) > 5:
            t.logprobs[5] += 0.02
    logs = update(cfg, ops, opt, trajs, keep, 0)
    assert logs["consistency/logprob_abs_diff_mean"] < cfg.health.parity_tolerance["fp32"]
    with pytest.raises(P.ParityError) as e:
        P.gate(cfg, 0, logs)
    assert "qwen3_omni_thinker response positions 4-7 (the worst position 5: 0.02)" in str(e.value)


def test_the_gap_benchmark_dry_run_names_each_runs_settings(capsys):
    """The fp8 gaps need a GPU: the command the lead runs, dry (command lines only), on CPU."""
    from benchmarks.parity_gaps import main

    recipes = ["sd3_tiny_flowgrpo", "mmk12_tiny"]
    assert (
        main(["--dry-run", "--precisions", "fp8", "vllm", "--models", "tiny_models", "--recipes", *recipes])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(x.startswith("python scripts/train.py --recipe ") for x in lines)
    assert "--model.path tiny_models/sd3 " in lines[0] and "--rollout.precision fp8" in lines[0]
    assert "--health.no-parity" in lines[0] and "--rollout.backend vllm" in lines[3]
    assert main(["--dry-run", "--recipes", "no_such_recipe"]) == 2


def test_the_gap_benchmark_measures_both_fp8_settings(tiny_sd3, tmp_path):
    """FP8 runs (the CPU emulates the GEMMs): the FP8 rollout against the bf16 trainer's recompute, gated at
    the fp8 tolerance, and FP8 in both halves (one function), gated at bf16's with a smaller gap."""
    from benchmarks.parity_gaps import main

    out = tmp_path / "gaps.json"
    args = ["--precisions", "fp8", "fp8_train", "--recipes", "sd3_tiny_flowgrpo", "--out", str(out)]
    assert main([*args, "--model", f"sd3_tiny_flowgrpo={tiny_sd3}"]) == 0
    runs = {r["precision"]: r for r in json.loads(out.read_text())["runs"]}
    assert [runs[p]["status"] for p in ("fp8", "fp8_train")] == [0, 0], runs
    assert runs["fp8"]["gate_precision"] == "fp8" and runs["fp8_train"]["gate_precision"] == "bf16"
    assert 0 < runs["fp8_train"]["worst_gap"] < runs["fp8"]["worst_gap"] < runs["fp8"]["tolerance"]
