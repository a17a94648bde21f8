"""OpenAPI schema of the environment server's ``POST /request`` body, with the server's limits in it.

The body is polymorphic (``type_name`` picks the request class), so FastAPI cannot derive it from a route
signature; it is built here from the registered :class:`AgentRequest` classes, the in-process-only
``inference_interface`` field left out, and the configured limits written in as ``maximum`` / ``maxItems``.
"""
from __future__ import annotations

from typing import Any

from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import PydanticOmit

from megatron.rl.agent.api import AgentRequest
from megatron.rl.inference.validation import RequestLimits

__all__ = ["request_body_schema"]


class _SkipInProcessFields(GenerateJsonSchema):
    def handle_invalid_for_json_schema(self, schema: Any, error_info: Any) -> Any:
        raise PydanticOmit  # the backend object (inference_interface) never travels over HTTP


def request_body_schema(limits: RequestLimits, max_rollouts: int, max_ks: int,
                        num_prompts_required: bool = False) -> dict[str, Any]:
    """``{"oneOf": [...]}`` of the registered request types, each with ``type_name`` fixed and the server's
    limits set (``EnvServerConfig.limits`` / ``max_rollouts`` / ``max_ks``). ``num_prompts_required``: the
    environment cannot tell its evaluation split's size, so an evaluation request must bound its work itself."""
    variants = []
    for name, cls in AgentRequest.registered_types().items():
        schema = cls.model_json_schema(schema_generator=_SkipInProcessFields, ref_template="#/$defs/{model}")
        defs = schema.pop("$defs", {})
        schema = _inline(schema, defs)
        props = schema.setdefault("properties", {})
        props["type_name"] = {"type": "string", "enum": [name]}
        schema["required"] = sorted({*schema.get("required", []), "type_name"})
        schema["additionalProperties"] = False  # the server refuses unknown fields (422 naming them)
        for count in ("num_groups", "rollouts_per_group", "num_rollouts", "num_prompts", "num_samples"):
            if count in props:
                _set_max(props[count], max_rollouts)
        if "num_groups" in props:
            props["num_groups"]["minimum"] = 1  # an empty request is a client mistake over HTTP
        if num_prompts_required and "num_prompts" in props:
            props["num_prompts"] = next(o for o in props["num_prompts"].get("anyOf", [props["num_prompts"]])
                                        if o.get("type") == "integer")
            schema["required"] = sorted({*schema["required"], "num_prompts"})
        if "ks" in props:
            _set_max(props["ks"], max_ks, key="maxItems")
            for option in props["ks"].get("anyOf", [props["ks"]]):
                if option.get("type") == "array":
                    option.setdefault("items", {})["minimum"] = 1  # pass@k of k < 1 is refused (422)
        gen = props.get("generation_args", {}).get("properties", {})
        if gen:
            _set_max(gen["n"], limits.max_n)
            _set_max(gen["max_tokens"], limits.max_tokens)
            gen["stop"]["maxItems"] = limits.max_stop
            gen["stop"]["items"]["maxLength"] = limits.max_stop_chars
        variants.append(schema)
    return {"oneOf": variants}


def _set_max(prop: dict[str, Any], value: int, key: str = "maximum") -> None:
    for option in prop.get("anyOf", [prop]):
        if option.get("type") in ("integer", "array"):
            option[key] = value


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline(dict(defs[node["$ref"].rsplit("/", 1)[-1]]), defs)
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node
