"""Sleep/wake (omnirl/memory.py): what sleeps is freed and comes back bit-exact, the host chunks are
allocated once and reused, small tensors cross in one packed copy, modules give the same output after
waking, FSDP2 optimizer state survives (2 ranks), and training gives the same LoRA with sleep on and off."""

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import T5EncoderModel

from omnirl.memory import Sleeper, module_tensors, optimizer_state, phase
from omnirl.recipe import load_config
from omnirl.trainer import train

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


def storage_bits(t: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of `t`'s storage (NaN payloads and -0.0 included)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def some_tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(3000, generator=gen)  # 12000 bytes: straddles three 4 KiB chunks
    big[0], big[1] = float("nan"), -0.0
    weight = torch.randn(8, 8, generator=gen, requires_grad=True)
    weight.grad = torch.randn(8, 8, generator=gen)
    return [
        big,
        big[10:20],  # a view: its storage sleeps once, with its base
        *[torch.randn(n, generator=gen) for n in (1, 5, 17, 100)],
        torch.randn(33, generator=gen).bfloat16(),
        torch.arange(50, dtype=torch.int64),
        torch.randn(1500, generator=gen),  # 6000 bytes: large, after a run of small ones
        weight,
        weight.grad,
        torch.tensor(3.0),  # a 0-dim tensor (AdamW's step counter)
    ]


def test_sleep_frees_storage_and_wake_restores_it_bit_exact():
    tensors = some_tensors()
    before = [storage_bits(t) for t in tensors]
    unique_bytes = sum(t.untyped_storage().nbytes() for i, t in enumerate(tensors) if i != 1)
    sleeper = Sleeper(CPU, chunk_bytes=4096)
    assert sleeper.sleep("group", tensors) == unique_bytes
    assert all(t.untyped_storage().size() == 0 for t in tensors)
    assert sleeper.sleep("group", tensors) == 0  # already asleep: stays so, its host copy untouched
    assert sleeper.wake("group") == unique_bytes
    assert sleeper.wake("group") == 0
    for t, b in zip(tensors, before):
        assert torch.equal(storage_bits(t), b)
    tensors[0][15] = 42.0  # the view still shares its base's (restored) storage
    assert tensors[1][5] == 42.0


def test_host_chunks_are_allocated_once_and_reused():
    tensors = some_tensors()
    before = [storage_bits(t) for t in tensors]
    sleeper = Sleeper(CPU, chunk_bytes=4096)
    sleeper.sleep("a", tensors)
    chunks = list(sleeper.chunks)
    # 12000 bytes over chunks 0-2; small ones packed after them and in chunk 3; the 6000 bytes from chunk 3
    # into 4, followed there by the weight, its gradient and the counter.
    assert len(chunks) == 5
    sleeper.wake("a")
    for _ in range(3):
        sleeper.sleep("a", tensors)
        sleeper.wake("a")
        assert len(sleeper.chunks) == len(chunks)
        assert all(x is y for x, y in zip(sleeper.chunks, chunks))
    for t, b in zip(tensors, before):
        assert torch.equal(storage_bits(t), b)

    # Two groups asleep at once hold different chunks; once woken, their chunks serve the next sleep.
    other = [torch.randn(2000)]
    other_bits = storage_bits(other[0])
    sleeper.sleep("a", tensors)
    sleeper.sleep("b", other)
    assert len(sleeper.chunks) == len(chunks) + 2
    sleeper.wake("a")
    sleeper.wake("b")
    assert torch.equal(storage_bits(other[0]), other_bits)
    sleeper.sleep("b", other)
    assert len(sleeper.chunks) == len(chunks) + 2
    # The lowest free chunks come back first.
    assert torch.equal(torch.cat([sleeper.chunks[0], sleeper.chunks[1][: 8000 - 4096]]), other_bits)
    sleeper.wake("b")


def test_reserved_chunks_serve_the_first_sleeps():
    """`reserve` allocates the chunks in a thread; the sleeps that follow take them and allocate none."""
    tensors = some_tensors()
    before = [storage_bits(t) for t in tensors]
    sleeper = Sleeper(CPU, chunk_bytes=4096)
    assert sleeper.reserve(7 * 4096 - 100) == 7
    assert sleeper.reserve(3 * 4096) == 0  # held (or being made) already
    sleeper.sleep("a", tensors)  # five chunks
    sleeper.sleep("b", [torch.randn(500)])  # one more
    assert len(sleeper.chunks) == 7 and sleeper.host_bytes == 7 * 4096
    sleeper.sleep("c", [torch.randn(2000)])  # two: one reserved, one allocated now
    assert len(sleeper.chunks) == 8
    for name in "abc":
        sleeper.wake(name)
    for t, b in zip(tensors, before):
        assert torch.equal(storage_bits(t), b)


def test_a_sleep_of_nothing_leaves_the_reservation_running():
    """Step 0's rollout sleeps no optimizer state: it must not wait while the reserved chunks are pinned
    (the train phase's sleep, a rollout later, takes them)."""
    sleeper = Sleeper(CPU, chunk_bytes=4096)
    release = threading.Event()
    sleeper._reserving = threading.Thread(target=release.wait, args=(30,), daemon=True)
    sleeper._reserving.start()
    assert sleeper.sleep("optimizer", []) == 0
    assert sleeper._reserving is not None and sleeper._reserving.is_alive()
    release.set()
    sleeper.sleep("a", [torch.randn(100)])  # needs a chunk: waits for the reservation, then allocates
    assert sleeper._reserving is None and len(sleeper.chunks) == 1
    sleeper.wake("a")


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def test_small_tensors_cross_packed_in_one_copy():
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(16, generator=gen) for _ in range(1000)]
    flat = torch.cat([t.view(torch.uint8) for t in tensors])
    sleeper = Sleeper(CPU)
    sleeper.sleep("small", tensors)
    sleeper.wake("small")
    with CountOps() as sleeping:
        sleeper.sleep("small", tensors)
    assert torch.equal(sleeper.chunks[0][: len(flat)], flat)  # packed tight, in order
    with CountOps() as waking:
        sleeper.wake("small")
    assert sleeping.ops["copy_"] == 1 and sleeping.ops["cat"] == 1, sleeping.ops
    assert waking.ops["copy_"] == 1 and waking.ops["split_with_sizes_copy"] == 1, waking.ops
    assert torch.equal(torch.cat([t.view(torch.uint8) for t in tensors]), flat)


@pytest.mark.slow
def test_modules_sleep_and_give_the_same_output(tiny_sd3):
    """The tiny SD3 VAE and T5 as loaded from disk: on CPU their storages are mmap'd from the safetensors
    files and cannot be resized, so the first sleep also moves them to storages that can."""
    vae = AutoencoderKL.from_pretrained(tiny_sd3, subfolder="vae").eval()
    t5 = T5EncoderModel.from_pretrained(tiny_sd3, subfolder="text_encoder_3").eval()
    tensors = module_tensors([vae, t5])
    assert not all(t.untyped_storage().resizable() for t in tensors)
    latents = torch.randn(2, vae.config.latent_channels, 8, 8, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[5, 9, 2, 1], [7, 3, 1, 0]])
    with torch.no_grad():
        image, hidden = vae.decode(latents).sample, t5(ids).last_hidden_state
    sleeper = Sleeper(CPU, chunk_bytes=1 << 16)
    for _ in range(2):
        assert sleeper.sleep("offload", module_tensors([vae, t5])) > 0
        assert all(t.untyped_storage().size() == 0 for t in module_tensors([vae, t5]))
        sleeper.wake("offload")
        with torch.no_grad():
            assert torch.equal(vae.decode(latents).sample, image)
            assert torch.equal(t5(ids).last_hidden_state, hidden)
    assert t5.shared.weight is t5.encoder.embed_tokens.weight  # tied weights stay tied


@pytest.mark.slow
def test_optimizer_state_sleeps_from_its_first_step_on():
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sleeper = Sleeper(CPU)
    stats: dict[str, float] = {}
    with phase("rollout", stats, sleeper, sleep={"optimizer": optimizer_state(opt)}):
        pass  # no state before the first step: nothing to move
    assert stats["mem/rollout_sleep_gib"] == 0 and sleeper.is_asleep("optimizer")
    model(torch.ones(2, 8)).sum().backward()
    with phase("train", stats, sleeper, wake=["optimizer"]):
        opt.step()
    state = optimizer_state(opt)
    assert len(state) == 6  # exp_avg, exp_avg_sq, step for weight and bias
    state_bytes = sum(t.untyped_storage().nbytes() for t in state)
    before = [storage_bits(t) for t in state]
    with phase("rollout", stats, sleeper, sleep={"optimizer": state}):
        assert all(t.untyped_storage().size() == 0 for t in state)
    assert stats["mem/rollout_sleep_gib"] * 2**30 == state_bytes
    with phase("train", stats, sleeper, wake=["optimizer"]):
        assert all(torch.equal(storage_bits(t), b) for t, b in zip(state, before))
    assert stats["mem/train_wake_gib"] * 2**30 == state_bytes
    assert {"time/rollout_sleep_s", "time/train_wake_s", "time/rollout_s", "mem/host_gib"} <= set(stats)


def test_a_sleeping_engines_released_memory_is_not_in_the_phase_peak(monkeypatch):
    """vLLM's sleep releases its pool to the driver while torch's allocator still counts the blocks as
    allocated: the phase subtracts what the engine reports (`asleep_bytes`) from the peak, only while the
    engine sleeps through it."""
    from omnirl import memory

    class Accel:  # torch.cuda's peak counter: 50 GiB allocated, 40 of them the engine's pool
        def reset_peak_memory_stats(self):
            pass

        def max_memory_allocated(self):
            return 50 * 2**30

        def max_memory_reserved(self):
            return 52 * 2**30

    class Engine:
        asleep_bytes = 0

        def sleep(self):
            self.asleep_bytes = 40 * 2**30

        def wake(self):
            self.asleep_bytes = 0

    monkeypatch.setattr(memory, "_accel", Accel)
    monkeypatch.setattr(memory, "synchronize", lambda: None)
    monkeypatch.setattr(memory, "empty_cache", lambda: None)
    engine, stats = Engine(), {}
    with phase("train", stats, Sleeper(CPU), engine=engine, engine_awake=False):
        pass
    assert stats["mem/train_peak_gib"] == 10 and stats["mem/train_engine_asleep_gib"] == 40
    assert stats["mem/train_reserved_gib"] == 12  # the reservation less the engine's released pool too
    with phase("rollout", stats, Sleeper(CPU), engine=engine, engine_awake=True):
        pass
    assert stats["mem/rollout_peak_gib"] == 50 and stats["mem/rollout_engine_asleep_gib"] == 0


def test_a_cap_is_the_memory_every_decision_counts_from(monkeypatch):
    """Under `cap_device_memory` the process sees a smaller device: the free memory, the checkpointing
    margin and the sleep decision all count from the cap, not from the card's size."""
    from omnirl import autotune, memory

    gib = 2**30

    class Accel:  # an 80 GiB card, 10 GiB allocated, 12 reserved, 60 free to the driver
        fraction = None

        def get_device_properties(self, device):
            return type("Props", (), {"total_memory": 80 * gib})()

        def set_per_process_memory_fraction(self, fraction, device):
            Accel.fraction = fraction

        def mem_get_info(self, device):
            return 60 * gib, 80 * gib

        def memory_allocated(self, device):
            return 10 * gib

        def memory_reserved(self, device):
            return 12 * gib

    monkeypatch.setattr(memory, "_accel", Accel)
    monkeypatch.setattr(memory, "_cap", {})
    card = torch.device("cuda", 0)
    assert memory.device_bytes(card) == 80 * gib and memory.free_bytes(card) == 62 * gib
    memory.cap_device_memory(40, card)
    assert Accel.fraction == 0.5 and memory.device_bytes(card) == 40 * gib
    assert memory.free_bytes(card) == 30 * gib  # the cap less what is allocated
    # 28 GiB of peak + 2 GiB of margin (5% of the cap) fits the 30 GiB the cap leaves; 5% of the card (4 GiB)
    # would not.
    assert not autotune.decide(28 * gib, memory.free_bytes(card), 0, memory.device_bytes(card), 8).on
    assert autotune.decide(28 * gib, memory.free_bytes(card), 0, 80 * gib, 8).on
    with pytest.raises(ValueError, match="more than the device"):
        memory.cap_device_memory(100, card)


@pytest.mark.slow
def test_fsdp2_optimizer_state_sleeps_and_wakes_bit_exact():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    r = subprocess.run(
        [*cmd, "tests/_fsdp_sleep.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert r.stdout.count("sleep/wake OK") == 2


@pytest.mark.slow
def test_training_gives_the_same_lora_with_sleep_on_and_off(tiny_sd3, tmp_path):
    weights, metrics = {}, {}
    for sleep in ("true", "false"):
        out = tmp_path / sleep
        cfg = load_config(
            "sd3_tiny_flowgrpo",
            [
                *("--model.path", str(tiny_sd3), "--run.output_dir", str(out), "--run.steps", "2"),
                *("--rollout.prompts_per_step", "2", "--rollout.group_size", "4", "--log.image_every", "0"),
                *("--memory.sleep", sleep),
            ],
        )
        train(cfg)
        weights[sleep] = load_file(out / "lora/pytorch_lora_weights.safetensors")
        metrics[sleep] = [json.loads(line) for line in open(out / "metrics.jsonl")]
    on, off = metrics["true"], metrics["false"]
    # Sleeping really happened: the optimizer state from step 1 on, the text encoders and VAE every step.
    assert on[0]["mem/rollout_sleep_gib"] == 0 and on[1]["mem/rollout_sleep_gib"] > 0
    assert on[1]["mem/train_wake_gib"] == on[1]["mem/rollout_sleep_gib"]
    assert all(m["mem/train_sleep_gib"] > 0 for m in on)
    assert on[1]["mem/rollout_wake_gib"] == on[0]["mem/train_sleep_gib"]
    # The host chunks both groups need were reserved before step 0: step 1's sleep allocated none.
    assert on[0]["mem/host_gib"] == on[1]["mem/host_gib"] == 2
    assert not any(k.endswith("_sleep_gib") for m in off for k in m)
    a, b = weights["true"], weights["false"]
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_what_a_compile_left_is_frozen_and_later_garbage_still_collected():
    """After dynamo compiled a graph, `freeze_compiled` moves the survivors out of the full collections
    (what the compile made is not walked again); without a new graph it does nothing; a reference cycle
    made afterwards is still collected by `empty_cache`."""
    import gc
    import weakref

    from omnirl import memory

    gc.unfreeze()
    try:
        memory.freeze_compiled()  # whatever earlier tests compiled
        assert not memory.freeze_compiled()  # nothing new: no freeze
        f = torch.compile(lambda x: x * 2 + 1, backend="eager")
        f(torch.ones(3))
        before = gc.get_freeze_count()
        assert memory.freeze_compiled() and gc.get_freeze_count() > before
        assert not memory.freeze_compiled()

        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        dead = weakref.ref(a)
        del a, b
        memory.empty_cache()
        assert dead() is None
    finally:
        gc.unfreeze()


def test_the_update_peak_a_sleep_decision_reads_leaves_the_checkpointing_probe_out(monkeypatch):
    """Step 0's update runs `auto`'s probe without checkpointing first (on Wan2.2 TI2V-5B: 76.5 GiB, which
    turned checkpointing on; the update then peaked at 20.4 GiB). The phase's peak and reservation, which
    memory.sleep auto reads, are the update's own: what the probe held is handed back and forgotten."""
    from omnirl import autotune, memory

    gib = 2**30

    class Accel:  # torch.cuda's peak counters over a simulated allocation level
        now = peak = 2 * gib

        @classmethod
        def reset_peak_memory_stats(cls, *device):
            cls.peak = cls.now

        @classmethod
        def max_memory_allocated(cls, *device):
            return cls.peak

        @classmethod
        def max_memory_reserved(cls, *device):
            return cls.peak

        @classmethod
        def empty_cache(cls):
            pass

    def touch(level: int) -> None:
        Accel.peak = max(Accel.peak, Accel.now + level)

    def probe(ops, optimizer, mb, normaliser):
        touch(76 * gib)
        return autotune.Decision(True, "a micro-batch does not fit without it")

    monkeypatch.setattr(memory, "_accel", Accel)
    monkeypatch.setattr(memory, "synchronize", lambda: None)
    monkeypatch.setattr(autotune, "probe_checkpointing", probe)
    monkeypatch.setattr(autotune, "set_checkpointing", lambda policy, on: None)
    auto, stats = autotune.AutoCheckpointing("auto"), {}
    with phase("train", stats, None):
        auto.maybe_decide(None, None, [object()], 1.0)  # step 0's update: the probe, then its micro-batches
        touch(18 * gib)
    assert auto.on
    assert stats["mem/train_peak_gib"] == 20 and stats["mem/train_reserved_gib"] == 20
