"""run.compile_cache: where inductor keeps compiled graphs for later processes, and the line the trainer
says about it at start."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from omnirl import trainer
from omnirl.errors import ConfigError
from omnirl.recipe import config_for, load_config
from omnirl.rollout import compiled

# One process: import diffusers, take the cache directory 'auto' gives, compile a function with inductor,
# report the FX graph cache's hits and misses.
COMPILE_ONCE = textwrap.dedent(
    """
    import json, sys
    import diffusers  # as the trainer does: inductor's default directory is in the variable from here on
    import torch
    from torch._dynamo.utils import counters
    from omnirl.rollout.compiled import use_cache_dir

    use_cache_dir("auto")
    f = torch.compile(lambda x: (x.sin() * 2 + 1).relu(), backend="inductor")
    f(torch.arange(16.0))
    print(json.dumps({k: counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}))
    """
)


def test_auto_keeps_the_variable_else_takes_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(compiled.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    want = tmp_path / "xdg" / "omnirl" / "torchinductor"
    assert compiled.use_cache_dir("auto") == want
    assert compiled.os.environ[compiled.CACHE_ENV] == str(want)
    # What inductor writes into the variable itself (on importing diffusers) is its /tmp default: not kept.
    monkeypatch.setenv(compiled.CACHE_ENV, default_cache_dir())
    assert compiled.use_cache_dir("auto") == want
    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path / "mine"))
    assert compiled.use_cache_dir("auto") == tmp_path / "mine"  # the user's variable stands
    assert compiled.use_cache_dir(str(tmp_path / "given")) == tmp_path / "given"  # a path wins over it
    assert compiled.os.environ[compiled.CACHE_ENV] == str(tmp_path / "given")


@pytest.mark.slow
def test_a_later_process_loads_the_graphs_an_earlier_one_compiled(tmp_path):
    """The directory 'auto' takes, in a process that imported diffusers first as the trainer does, is where
    inductor writes and reads: the first process compiles (a miss) and leaves graphs there, the second loads
    them (a hit) instead of compiling."""
    cache = tmp_path / "xdg" / "omnirl" / "torchinductor"
    env = {k: v for k, v in compiled.os.environ.items() if k != compiled.CACHE_ENV}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")

    def run() -> dict:
        out = subprocess.run(
            [sys.executable, "-c", COMPILE_ONCE], capture_output=True, text=True, check=True, env=env
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert compiled.cached_graphs(cache) == 0
    first = run()
    assert first["fxgraph_cache_miss"] >= 1 and first["fxgraph_cache_hit"] == 0
    held = compiled.cached_graphs(cache)
    assert held >= 1
    second = run()
    assert second["fxgraph_cache_hit"] >= 1 and second["fxgraph_cache_miss"] == 0
    assert compiled.cached_graphs(cache) == held  # nothing compiled anew


def test_the_trainer_says_where_the_cache_is_and_what_it_holds(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(compiled.CACHE_ENV, raising=False)
    cfg = config_for("sd3")
    cfg.run.compile_cache = str(tmp_path / "c")
    trainer.compile_cache(cfg)  # nothing compiles: nothing said, nothing set
    assert capsys.readouterr().out == "" and compiled.CACHE_ENV not in compiled.os.environ
    cfg.rollout.compile = True
    trainer.compile_cache(cfg)
    assert capsys.readouterr().out.strip() == (
        f"compile cache: {tmp_path / 'c'} (empty: step 0 compiles every graph)"
    )
    for part in compiled.CACHE_PARTS:
        (tmp_path / "c" / part / "entry").mkdir(parents=True)
    trainer.compile_cache(cfg)
    assert "(2 compiled graphs of earlier runs)" in capsys.readouterr().out


def test_an_empty_cache_path_is_refused_naming_the_field():
    assert config_for("sd3").run.compile_cache == "auto"  # the default
    with pytest.raises(ConfigError, match=r"run\.compile_cache must be 'auto' or a directory"):
        load_config("sd3_tiny_flowgrpo", ["--run.compile_cache", " "])


def test_the_compile_meter_counts_a_steps_compiling_and_nothing_once_compiled():
    """time/compile_s and compile/graphs, as the trainer logs them each step: the first call's compile with
    its backward's (compiled at the first backward), nothing for a call that meets its graph again, one
    graph for a call whose shape recompiles."""
    meter = compiled.CompileMeter()
    f = torch.compile(lambda x: (x.sin() * 2).relu().sum(), backend="aot_eager")
    x = torch.randn(8, requires_grad=True)
    began = time.perf_counter()
    f(x).backward()
    wall = time.perf_counter() - began
    first = meter.take()
    assert first["compile/graphs"] == 1 and 0 < first["time/compile_s"] <= wall
    f(x).backward()
    assert meter.take() == {"time/compile_s": 0.0, "compile/graphs": 0.0}
    f(torch.randn(3, requires_grad=True)).backward()
    again = meter.take()
    assert again["compile/graphs"] == 1 and again["time/compile_s"] > 0
    # A step's rollout as a part: its seconds named apart, inside the step's.
    with meter.part("rollout"):
        f(torch.randn(5, 2, requires_grad=True)).backward()  # another rank: another graph
    f(torch.randn(6, 2, 2, requires_grad=True)).backward()
    step = meter.take()
    assert step["compile/graphs"] == 2 and 0 < step["time/rollout_compile_s"] < step["time/compile_s"]
    assert "time/rollout_compile_s" not in meter.take()  # a part counts until the next take
