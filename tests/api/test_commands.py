"""The service's commands and the HTTP models describe the same inputs, field for field.

A plain body is decoded straight into a command (``kv_slot_tracker.service.commands``); any other body is
validated by its pydantic model (``kv_slot_tracker.http.schemas``), which also writes the OpenAPI document
and the reference's error texts. Both must accept exactly the same fields: same names, types,
bounds and defaults. These tests read both definitions and compare them, so a field changed in
one and not the other fails here rather than as a difference between the two paths.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
import msgspec
import msgspec.inspect as mi
import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kv_slot_tracker.core import commands as core
from kv_slot_tracker.core.types import U64_MAX
from kv_slot_tracker.http import schemas as s
from kv_slot_tracker.service import commands as c

# A description of one type: ``("int", ge, le)``, ``("float", ge, le)``, ``("str", max_length)``,
# ``("bool",)``, ``("null",)``, ``("list", item)`` or a frozenset of those (a union).
Kind = Any


def _one(kinds: set[Kind]) -> Kind:
    """A union's description: its members, nested unions flattened."""
    flat = set()
    for k in kinds:
        flat |= k if isinstance(k, frozenset) else {k}
    return next(iter(flat)) if len(flat) == 1 else frozenset(flat)


def of_struct(t: mi.Type) -> Kind:
    """A msgspec type, described. msgspec decodes integers up to U64_MAX and beyond; an
    unbounded one (``U64``) is checked against U64_MAX by the edge after decoding."""
    if isinstance(t, mi.IntType):
        return ("int", t.ge, U64_MAX if t.le is None else t.le)
    if isinstance(t, mi.FloatType):
        return ("float", t.ge, t.le)
    if isinstance(t, mi.StrType):
        return ("str", t.max_length)
    if isinstance(t, mi.BoolType):
        return ("bool",)
    if isinstance(t, mi.NoneType):
        return ("null",)
    if isinstance(t, mi.ListType):
        return ("list", of_struct(t.item_type))
    if isinstance(t, mi.UnionType):
        return _one({of_struct(u) for u in t.types})
    raise AssertionError(f"no description for {t!r}")


def _bounds(meta: list[Any]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for m in meta:
        if isinstance(m, FieldInfo):
            found.update(_bounds(m.metadata))
        elif isinstance(m, at.Ge):
            found["ge"] = m.ge
        elif isinstance(m, at.Le):
            found["le"] = m.le
        elif isinstance(m, at.MaxLen):
            found["max_length"] = m.max_length
    return found


def of_model(tp: Any, meta: list[Any]) -> Kind:
    """A pydantic annotation with the constraints ``meta`` around it, described."""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extra = get_args(tp)
        return of_model(base, [*meta, *extra])
    if origin in (Union, types.UnionType):
        return _one({of_model(a, meta) for a in get_args(tp)})
    if origin is list:
        return ("list", of_model(get_args(tp)[0], []))
    b = _bounds(meta)
    if tp is bool:
        return ("bool",)
    if tp is int:
        return ("int", b.get("ge"), b.get("le"))
    if tp is float:
        return ("float", b.get("ge"), b.get("le"))
    if tp is str:
        return ("str", b.get("max_length"))
    if tp is type(None):
        return ("null",)
    raise AssertionError(f"no description for {tp!r}")


def model_fields(model: type[BaseModel]) -> dict[str, tuple[Kind, bool, Any]]:
    """Each field's ``(type, required, default)``."""
    out = {}
    for name, f in model.model_fields.items():
        if name == "op":
            continue
        kind = of_model(f.annotation, list(f.metadata))
        out[name] = (kind, f.is_required(), None if f.is_required() else f.default)
    return out


def struct_fields(cmd: type[msgspec.Struct]) -> dict[str, tuple[Kind, bool, Any]]:
    """Each field's ``(type, required, default)``. A prompt form not given is UNSET in the
    command and None in the model; neither accepts a JSON null."""
    out = {}
    for f in mi.type_info(cmd).fields:
        default = None if f.required or f.default is msgspec.NODEFAULT else f.default
        out[f.name] = (of_struct(f.type), f.required, default)
    return out


PAIRS = [
    (s.AddBody, c.Add),
    (s.AddBody, core.Add),
    (s.RequestBody, c.Free),
    (s.RequestBody, c.PrefillComplete),
    (s.OutputBlockBody, c.OutputBlock),
    (s.PotentialLoadsBody, c.PotentialLoads),
    (s.ProjectLoadsBody, c.ProjectLoads),
    (s.BatchAdd, c.Add),
    (s.BatchFree, c.Free),
    (s.BatchPrefillComplete, c.PrefillComplete),
    (s.BatchOutputBlock, c.OutputBlock),
]


@pytest.mark.parametrize(("model", "cmd"), PAIRS, ids=lambda x: x.__name__)
def test_the_model_and_the_command_declare_the_same_fields(
    model: type[BaseModel], cmd: type[msgspec.Struct]
) -> None:
    assert model_fields(model) == struct_fields(cmd)


def test_an_add_is_declared_once_in_the_core() -> None:
    """The service's add is the core's struct, tagged for ``/batch``: it declares no field of
    its own, so the tracker reads the command the edge decoded, with no copy per call."""
    assert issubclass(c.Add, core.Add)
    assert c.Add.__struct_fields__ == core.Add.__struct_fields__
    assert set(vars(c.Add)) & set(core.Add.__struct_fields__) == set()
    assert c.Keyed is core.Keyed and c.Prompt is core.Prompt


def test_prompt_forms_default_to_unset_and_refuse_null() -> None:
    for cmd in (c.Add, c.PotentialLoads, c.ProjectLoads):
        fields = {f.name: f for f in mi.type_info(cmd).fields}
        for name in ("sequence_hashes", "token_ids"):
            assert fields[name].default is msgspec.NODEFAULT and not fields[name].required
            assert not isinstance(fields[name].type, mi.UnionType)  # no null


def test_the_batch_union_is_the_models_union() -> None:
    """Each ``op`` names the same operation in the models' union and the commands' union."""
    members = get_args(get_args(s.BatchOperation)[0])
    by_op = {get_args(m.model_fields["op"].annotation)[0]: m for m in members}
    tags = {mi.type_info(cmd).tag: cmd for cmd in get_args(c.BatchOperation)}
    assert set(by_op) == set(tags) == {"add", "free", "prefill_complete", "output_block"}
    for op, model in by_op.items():
        assert get_origin(model.model_fields["op"].annotation) is Literal
        assert model_fields(model) == struct_fields(tags[op])
    assert all(mi.type_info(cmd).tag_field == "op" for cmd in tags.values())


def test_commands_are_keyword_only() -> None:
    for _, cmd in PAIRS:
        assert set(cmd.__struct_fields__) == set(cmd.__struct_encode_fields__)
        with pytest.raises(TypeError):
            cmd("m")  # type: ignore[call-arg]


def test_the_descriptions_see_a_difference() -> None:
    """The comparison is not vacuous: a bound, a default or a type changed is told apart."""
    add = struct_fields(c.Add)
    assert add["dp_rank"] == (("int", 0, 0xFFFF_FFFF), True, None)
    assert add["routing_group"] == (("str", 1024), False, "default")
    assert add["expected_prefill_ms"][0] == frozenset(
        {("int", 0, 10**12), ("float", 0, 1e12), ("null",)}
    )
    assert add != struct_fields(c.PotentialLoads)
    assert typing.get_type_hints(c.Add, include_extras=True)  # every annotation resolves
