"""Every registered adapter class against the Protocol of its kind: each member the Protocol declares is
there, and each method accepts the Protocol's call (the same parameters, in order, defaults where the
Protocol has them; anything more only with a default)."""

from __future__ import annotations

import inspect
import typing

import pytest

from omnirl.models import ADAPTERS, get_adapter
from omnirl.models.base import DiffusionAdapter, OmniAdapter
from omnirl.models.sd3.adapter import SD3Adapter
from omnirl.ops import OPS

PROTOCOLS = {"diffusion": DiffusionAdapter, "omni": OmniAdapter}


def declared(proto: type) -> dict[str, object]:
    """The members a Protocol declares: name -> its function, property or type hint."""
    hints = typing.get_type_hints(proto)
    members: dict[str, object] = {n: v for n, v in vars(proto).items() if not n.startswith("_")}
    return {**{n: hints[n] for n in proto.__annotations__}, **members}


def signature_problem(want: inspect.Signature, have: inspect.Signature) -> str | None:
    """Why a method with signature `have` cannot be called as the Protocol's `want` is, or None."""
    want_params = list(want.parameters.values())[1:]  # without self
    have_params = list(have.parameters.values())[1:]
    P = inspect.Parameter
    variadic = {p.kind for p in have_params} & {P.VAR_POSITIONAL, P.VAR_KEYWORD}
    for i, w in enumerate(want_params):
        h = have.parameters.get(w.name)
        if h is None:
            if variadic:
                continue
            return f"has no parameter {w.name!r}"
        if w.kind in (w.POSITIONAL_ONLY, w.POSITIONAL_OR_KEYWORD) and have_params.index(h) != i:
            return f"takes {w.name!r} at position {have_params.index(h)}, the Protocol at {i}"
        if w.default is not w.empty and h.default is h.empty:
            return f"needs {w.name!r}, which the Protocol lets callers leave out"
    names = {w.name for w in want_params}
    for h in have_params:
        if h.name not in names and h.default is h.empty and h.kind not in (h.VAR_POSITIONAL, h.VAR_KEYWORD):
            return f"needs {h.name!r}, which the Protocol's callers never pass"
    return None


def mismatches(cls: type, proto: type) -> list[str]:
    """What `cls` lacks of `proto`: one line per missing member or incompatible method."""
    annotated = {n for klass in cls.__mro__ for n in getattr(klass, "__annotations__", {})}
    out = []
    for name, member in declared(proto).items():
        if inspect.isfunction(member):
            impl = inspect.getattr_static(cls, name, None)
            if not callable(impl) or isinstance(impl, property):
                out.append(f"{name}: not a method")
                continue
            problem = signature_problem(inspect.signature(member), inspect.signature(getattr(cls, name)))
            if problem:
                out.append(f"{name}: {problem}")
        elif typing.get_origin(member) is typing.ClassVar:
            if not hasattr(cls, name):
                out.append(f"{name}: no class attribute")
        elif not hasattr(cls, name) and name not in annotated:  # a property, or set by __init__
            out.append(f"{name}: missing")
    return out


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_every_adapter_implements_the_protocol_of_its_kind(name):
    cls = get_adapter(name)
    assert cls.kind in PROTOCOLS and cls.kind in OPS, f"{name}: kind {cls.kind!r}"
    assert mismatches(cls, PROTOCOLS[cls.kind]) == []


def test_the_check_finds_a_missing_member_and_a_wrong_signature():
    class Partial:  # a diffusion adapter that forgot most of the Protocol
        kind = "diffusion"
        device = None

        def rollout(self, requests):
            return []

    found = mismatches(Partial, DiffusionAdapter)
    assert "rollout: has no parameter 'requests'" not in found  # what is there passes
    assert {"modalities: no class attribute", "policy: missing", "velocity: not a method"} <= set(found)
    assert "kind: no class attribute" not in found and "device: missing" not in found

    class Reordered(SD3Adapter):
        def velocity(self, sigmas, latents, embeds, guidance_scale, fused_cfg=True, policy=None):
            raise NotImplementedError

        def export_lora(self, out_dir, state_dict, extra):
            raise NotImplementedError

    assert mismatches(Reordered, DiffusionAdapter) == [
        "velocity: takes 'latents' at position 1, the Protocol at 0",
        "export_lora: needs 'state_dict', which the Protocol lets callers leave out",
    ]
    assert mismatches(SD3Adapter, DiffusionAdapter) == []
