"""The structured-output fields of an OpenAI request: `response_format` (`json_object`,
`json_schema`) and vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and
`structured_outputs` ({json|regex|choice|grammar|json_object: ...}), one per request, read into
one (kind, spec) for `SamplingParams.structured_output`. Only their shape is checked here; the
prefill node compiles the spec (one that does not compile is a 400 from there)."""

from __future__ import annotations

import json

from pd.wire.sampling_params import MAX_STRUCTURED_SPEC
from router.errors import bad_param

STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "structured_outputs")


def _schema(name: str, v) -> tuple[str, str]:
    """A JSON schema given as an object (or as its JSON text)."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise bad_param(name, "must be a JSON schema (an object, or its JSON text)") from None
    if not isinstance(v, (dict, bool)):
        raise bad_param(name, "must be a JSON schema (an object)")
    return ("json", json.dumps(v, ensure_ascii=False))


def _text(name: str, v) -> str:
    if not isinstance(v, str) or not v:
        raise bad_param(name, "must be a non-empty string")
    return v


def _choices(name: str, v) -> tuple[str, str]:
    if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
        raise bad_param(name, "must be a non-empty list of non-empty strings")
    return ("choice", json.dumps(v, ensure_ascii=False))


# kind -> its spec from a field's value, named for the error (`guided_<kind>` and
# `structured_outputs[kind]` alike)
_SPECS = {"json": _schema,
          "regex": lambda name, v: ("regex", _text(name, v)),
          "choice": _choices,
          "grammar": lambda name, v: ("grammar", _text(name, v))}


def _response_format(rf) -> tuple[str, str] | None:
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(rf, dict) or rf.get("type") not in kinds:
        raise bad_param("response_format", "must be {'type': 'text'}, {'type': 'json_object'} or "
                                           "{'type': 'json_schema', 'json_schema': {'name': str, "
                                           "'schema': object}}")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return ("json_object", "")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad_param("response_format", "json_schema must be an object with a 'schema'")
    schema = js.get("schema")
    return ("json_object", "") if schema is None else _schema("response_format", schema)


def parse_structured(body: dict) -> tuple[str, str] | None:
    """The one structured-output constraint of a request body: (kind, spec) for
    `SamplingParams.structured_output`, or None; a malformed field, or two at once, is a 400
    naming it."""
    found: list[tuple[str, tuple[str, str]]] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    for kind, make in _SPECS.items():
        name = f"guided_{kind}"
        if body.get(name) is not None:
            found.append((name, make(name, body[name])))
    so = body.get("structured_outputs")
    if so is not None:
        name = "structured_outputs"
        given = {k: v for k, v in so.items() if v is not None} if isinstance(so, dict) else None
        if not given or len(given) != 1 or not set(given) <= {*_SPECS, "json_object"}:
            raise bad_param(name, "must be an object with one of json, regex, choice, grammar, "
                                  "json_object")
        (key, v), = given.items()
        if key == "json_object":
            if v is not True:
                raise bad_param(name, "json_object must be true")
            found.append((name, ("json_object", "")))
        else:
            found.append((name, _SPECS[key](name, v)))
    if len(found) > 1:
        raise bad_param(found[1][0], f"only one structured-output constraint per request (also "
                                     f"given: {found[0][0]})")
    if found and len(found[0][1][1]) > MAX_STRUCTURED_SPEC:
        raise bad_param(found[0][0], f"is longer than {MAX_STRUCTURED_SPEC} characters")
    return found[0][1] if found else None
