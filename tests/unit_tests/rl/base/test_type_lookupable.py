"""TypeLookupable registry: decorator registration, unwrap, polymorphic JSON, duplicate and missing names."""
from typing import ClassVar

import pytest
from pydantic import ValidationError

from megatron.rl.agent.api import (Agent, AgentRequest, AgentResponse, EvaluationRequest, GroupedRolloutRequest,
                                   GroupedRolloutResponse)
from megatron.rl.base.type_lookupable import TypeLookupable, TypeLookupError
from megatron.rl.inference.api import GenerationArgs
from megatron.rl.base.types import Rollout, RolloutGroup, TokenRollout


class Shape(TypeLookupable):
    _type_registry: ClassVar[dict[str, type]] = {}
    color: str = "red"


@Shape.register_subclass()
class Square(Shape):
    side: float = 1.0


@Shape.register_subclass("circle")
class Circle(Shape):
    radius: float = 1.0


class Drawing(TypeLookupable):
    _type_registry: ClassVar[dict[str, type]] = {}
    shapes: list[Shape] = []


@Drawing.register_subclass("drawing")
class NamedDrawing(Drawing):
    title: str = ""


def test_register_names_default_and_explicit():
    assert Shape.registered_types() == {"Square": Square, "circle": Circle}
    assert Square().type_name == "Square" and Circle().type_name == "circle"
    assert Shape.lookup("circle") is Circle


def test_registries_of_different_roots_are_separate():
    assert "circle" not in Drawing.registered_types()
    with pytest.raises(TypeLookupError, match="unknown Drawing type 'circle'"):
        Drawing.lookup("circle")


def test_unwrap_base_object_into_subclass():
    base = Shape(type_name="circle", radius=2.5, color="blue")
    assert type(base) is Shape
    obj = base.unwrap()
    assert type(obj) is Circle and obj.radius == 2.5 and obj.color == "blue"
    assert obj.unwrap() is obj


def test_unwrap_rejects_unknown_fields_and_missing_type():
    with pytest.raises(TypeLookupError, match=r"unknown field\(s\) \['radius'\]"):
        Shape(type_name="Square", radius=3).unwrap()
    with pytest.raises(TypeLookupError, match="no type_name"):
        Shape().unwrap()


def test_registered_subclass_rejects_unknown_fields_directly():
    with pytest.raises(ValidationError, match="unknown field"):
        Circle(radius=1, radus=2)


def test_polymorphic_json_round_trip_nested():
    d = NamedDrawing(title="t", shapes=[Square(side=2), Circle(radius=3, color="green")])
    js = d.model_dump_json()
    back = Drawing.model_validate_json(js)
    assert type(back) is NamedDrawing
    assert [type(s) for s in back.shapes] == [Square, Circle]
    assert back.shapes[1].radius == 3 and back.shapes[1].color == "green"
    assert back == d


def test_missing_name_lists_registered_types():
    with pytest.raises(ValidationError, match=r"unknown Shape type 'triangle'; registered types: Square, circle"):
        Shape.model_validate({"type_name": "triangle"})


def test_duplicate_name_is_an_error():
    with pytest.raises(TypeLookupError, match="already registered"):
        @Shape.register_subclass("circle")
        class OtherCircle(Shape):
            pass
    assert Shape.lookup("circle") is Circle


def test_register_requires_subclass_and_type_name_must_match():
    with pytest.raises(TypeError):
        Shape.register_subclass("x")(NamedDrawing)
    with pytest.raises(ValidationError, match="does not match"):
        Circle(type_name="Square")


def test_request_and_response_types_round_trip():
    req = GroupedRolloutRequest(num_groups=3, rollouts_per_group=4, generation_args=GenerationArgs(temperature=0.5))
    back = AgentRequest.model_validate_json(req.model_dump_json())
    assert type(back) is GroupedRolloutRequest and back == req
    ev = AgentRequest.model_validate(EvaluationRequest(num_prompts=5, num_samples=4, ks=[1, 2]).model_dump())
    assert type(ev) is EvaluationRequest and ev.resolved_ks == [1, 2]
    tok = TokenRollout(prompt="p", completion="c", reward=1.0, token_ids=[5, 6, 7], generation_mask=[0, 1, 1],
                       logprobs=[0.0, -0.5, -1.5], prompt_length=1, env_id="e")
    failed = Rollout(prompt="p", completion="", reward=0.0, status="failed", failure_reason="boom")
    resp = GroupedRolloutResponse(groups=[RolloutGroup(rollouts=[tok, failed], env_id="e")])
    back = AgentResponse.model_validate_json(resp.model_dump_json())
    assert type(back) is GroupedRolloutResponse
    assert [type(r) for r in back.groups[0].rollouts] == [TokenRollout, Rollout]
    assert back == resp


def test_agent_registry_from_config():
    @Agent.register_subclass("test_echo_agent_for_registry")
    class Echo(Agent):
        word: str = "hi"

    a = Agent.from_config("test_echo_agent_for_registry", {"word": "yo"})
    assert type(a) is Echo and a.word == "yo" and a.name == "test_echo_agent_for_registry"
    assert type(Agent(type_name="test_echo_agent_for_registry", word="x").unwrap()) is Echo
    with pytest.raises(TypeLookupError, match="registered types: .*test_echo_agent_for_registry"):
        Agent.lookup("nope")
