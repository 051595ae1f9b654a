"""Step 0's memory probes kept for the next run of the same shapes (omnirl.probe_cache): a second run reads
the rollout's per-request cost and auto checkpointing's peaks instead of probing, decides the same, and a
run whose shapes differ, or whose file is damaged, measures again."""

import copy
import shutil

import pytest
import torch

from omnirl import autotune, probe_cache
from omnirl import distributed as D
from omnirl.batching import make_requests
from omnirl.config import RolloutConfig
from omnirl.data.prompts import load_prompts
from omnirl.models import get_adapter
from omnirl.ops.diffusion import sampling_params
from omnirl.phase_clock import PhaseClock, recording
from omnirl.rollout.diffusion import DiffusionEngine
from omnirl.step import UpdateTuning, update
from tests.test_train import tiny_cfg
from tests.test_update_tuning import rollout


@pytest.fixture
def cache(tmp_path):
    kept = probe_cache.ProbeCache(tmp_path / "probes" / "key.json")
    probe_cache.use(kept)
    yield kept
    probe_cache.use(None)


def test_the_run_key_follows_what_the_probes_depend_on(tiny_sd3, tmp_path):
    cpu = torch.device("cpu")
    cfg = tiny_cfg(tiny_sd3, tmp_path)
    key = probe_cache.run_key(cfg, cpu, 0, 1)
    same = copy.deepcopy(cfg)
    same.run.output_dir, same.run.steps, same.data.train_path = "elsewhere", 7, "other.jsonl"
    moved = tmp_path / "moved"
    shutil.copytree(tiny_sd3, moved)  # the same model at another path
    same.model.path = str(moved)
    assert probe_cache.run_key(same, cpu, 0, 1) == key
    for change in (
        lambda c: setattr(c.lora, "rank", c.lora.rank * 2),
        lambda c: setattr(c.sampling, "height", c.sampling.height * 2),
        lambda c: setattr(c.optim, "micro_batch_size", c.optim.micro_batch_size + 1),
    ):
        other = copy.deepcopy(cfg)
        change(other)
        assert probe_cache.run_key(other, cpu, 0, 1) != key
    assert probe_cache.run_key(cfg, cpu, 1, 2) != key  # another rank keeps its own
    config = moved / "transformer" / "config.json"
    config.write_text(config.read_text().replace('"num_layers": ', '"num_layers": 1'))  # another model
    assert probe_cache.run_key(same, cpu, 0, 1) != key


@pytest.mark.slow
def test_a_second_rollout_reads_the_kept_cost_instead_of_probing(tiny_sd3, tmp_path, cache):
    cfg = tiny_cfg(tiny_sd3, tmp_path, "--rollout.prompts_per_step", "1", "--rollout.group_size", "4",
                   "--sampling.num_steps", "3")  # fmt: skip
    dist = D.init_distributed()
    adapter = get_adapter("sd3")(cfg, dist.device)
    requests, _ = make_requests(cfg, load_prompts(cfg.data.train_path), 0, dist, sampling_params(cfg))
    clock = PhaseClock(dist.device, prefix="time/")

    def generate():
        engine = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=4, memory_budget_gib=1.0))
        with recording(clock):
            trajs = engine.generate(requests)
        return engine, trajs, clock.totals()

    first, images, parts = generate()
    assert parts["time/memory_probe_s"] > 0 and cache.path.is_file()
    second, again, parts = generate()  # a new engine, as a new run would build
    assert "time/memory_probe_s" not in parts  # nothing probed
    assert second.row_cost == first.row_cost
    for a, b in zip(images, again):
        assert torch.equal(a.output.image, b.output.image)
    # The kept cost still decides what fits: a budget for 2 requests refuses 4, naming 2.
    (fixed, per_row, _), = first.row_cost.values()  # fmt: skip
    budget = (fixed + 2.5 * per_row) / 2**30
    tight = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=4, memory_budget_gib=budget))
    with pytest.raises(ValueError, match="the largest rollout.max_num_seqs that fits is 2"):
        tight.generate(requests)
    # A damaged file is measured again (with a warning) and rewritten whole.
    cache.path.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable memory probes"):
        probe_cache.use(probe_cache.ProbeCache(cache.path))
    _, _, parts = generate()
    assert parts["time/memory_probe_s"] > 0
    assert probe_cache.ProbeCache(cache.path).entries["rollout"]


@pytest.mark.slow
def test_auto_checkpointing_decides_from_kept_peaks_without_probing(tiny_sd3, tmp_path, cache, monkeypatch):
    cfg, ops, trajs, keep = rollout(tiny_sd3, tmp_path)
    opt = torch.optim.AdamW([p for p in ops.policy.parameters() if p.requires_grad], lr=1e-2)
    measured = []
    measure = autotune.measure_peaks
    monkeypatch.setattr(autotune, "measure_peaks", lambda *a: measured.append(1) or measure(*a))
    logs = update(cfg, ops, opt, copy.deepcopy(trajs), keep, 0, UpdateTuning(cfg, ops))
    assert measured == [1] and cache.entries["checkpointing"]
    (kept,) = cache.entries["checkpointing"].values()
    assert set(kept["peaks"]) == {1, 2} and kept["oom"] is False
    again = update(cfg, ops, opt, copy.deepcopy(trajs), keep, 1, UpdateTuning(cfg, ops))
    assert measured == [1]  # the second run's decision came from the kept peaks
    assert again["train/gradient_checkpointing"] == logs["train/gradient_checkpointing"] == 0.0
    # Kept peaks that cannot fit now turn checkpointing on, as measured ones would.
    item = next(iter(cache.entries["checkpointing"]))
    cache.entries["checkpointing"][item] = {"peaks": {1: 1 << 50, 2: 1 << 51}, "oom": False}
    huge = update(cfg, ops, opt, copy.deepcopy(trajs), keep, 2, UpdateTuning(cfg, ops))
    assert measured == [1] and huge["train/gradient_checkpointing"] == 1.0
    autotune.set_checkpointing(ops.policy, False)
