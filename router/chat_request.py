"""The chat request (`/v1/chat/completions`): its messages (text parts, names, the history's
tool calls and tool results), `tools` and `tool_choice` (a forced choice becomes the reply's
structured output), and `parse_chat`, on the checks it shares with completions
(`router.protocol`)."""

from __future__ import annotations

import json

from pd.wire.sampling_params import MAX_TOP_LOGPROBS
from router.errors import bad_param
from router.protocol import CHAT_FIELDS, ApiRequest, bool_param, check_tokens, common_request, int_param
from router.tool_calls import tool_choice_schema

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _message(i: int, m) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_param("messages", f"{where} must be an object")
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise bad_param("messages", f"{where}.role must be one of {', '.join(CHAT_ROLES)}, "
                                    f"got {role!r}")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise bad_param("messages", f"{where}.content parts must be "
                                            f"{{'type': 'text', 'text': str}}")
            parts.append(part["text"])
        content = "".join(parts)
    elif content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise bad_param("messages", f"{where}.content must be a string or a list of text parts")
    out = {"role": role, "content": content}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if role == "assistant" and m.get("tool_calls") is not None:
        out["tool_calls"] = _history_calls(where, m["tool_calls"])
    if role == "tool" and m.get("tool_call_id") is not None:
        if not isinstance(m["tool_call_id"], str):
            raise bad_param("messages", f"{where}.tool_call_id must be a string")
        out["tool_call_id"] = m["tool_call_id"]
    return out


MAX_TOOLS = 128


def _tools(v) -> list[dict] | None:
    """OpenAI function tools, as the chat template receives them; None for none."""
    if v is None or v == []:
        return None
    if not isinstance(v, list) or len(v) > MAX_TOOLS:
        raise bad_param("tools", f"must be a list of at most {MAX_TOOLS} tools")
    out = []
    for i, t in enumerate(v):
        f = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(f, dict)
                and isinstance(f.get("name"), str) and f["name"]
                and isinstance(f.get("parameters", {}), dict)
                and isinstance(f.get("description", ""), str)):
            raise bad_param("tools", f"tools[{i}] must be {{'type': 'function', 'function': "
                                     f"{{'name': str, 'description': str, 'parameters': object}}}}")
        out.append({"type": "function", "function": {
            k: f[k] for k in ("name", "description", "parameters") if k in f}})
    return out


def _tool_choice(v, tools: list[dict] | None) -> str:
    """none, auto, required, or "function:<name>" for the function a {"type": "function",
    "function": {"name": ...}} choice forces (one of the tools)."""
    if v is None:
        return "auto" if tools else "none"
    if v == "none" or (v in ("auto", "required") and tools):
        return v
    if isinstance(v, dict) and tools:
        f = v.get("function")
        name = f.get("name") if v.get("type") == "function" and isinstance(f, dict) else None
        if name not in {t["function"]["name"] for t in tools}:
            raise bad_param("tool_choice", "a named choice must be {'type': 'function', "
                                           "'function': {'name': <one of the tools>}}")
        return f"function:{name}"
    raise bad_param("tool_choice", f"must be none, auto, required or a named function (the "
                                   f"last three with tools), got {v!r:.40}")


def _history_calls(where: str, calls) -> list[dict]:
    """An assistant message's earlier tool calls, arguments as objects for the template."""
    if not isinstance(calls, list):
        raise bad_param("messages", f"{where}.tool_calls must be a list")
    out = []
    for call in calls:
        f = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str)
                and isinstance(f.get("arguments", "{}"), str)):
            raise bad_param("messages", f"{where}.tool_calls entries must be {{'id': str, "
                                        f"'type': 'function', 'function': {{'name': str, "
                                        f"'arguments': str}}}}")
        try:
            args = json.loads(f.get("arguments", "{}"))
        except ValueError:
            args = f["arguments"]
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": f["name"], "arguments": args}})
    return out


def parse_chat(body: dict) -> ApiRequest:
    req = common_request(body, CHAT_FIELDS, "chat")
    mct = int_param(body, "max_completion_tokens", 1)
    if mct is not None:
        req.max_tokens = mct
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_param("messages", "is required and must be a non-empty list")
    req.messages = [_message(i, m) for i, m in enumerate(messages)]
    want = bool_param(body, "logprobs")
    top = int_param(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not want:
        raise bad_param("top_logprobs", "requires logprobs to be true")
    req.logprobs = (top or 0) if want else None
    req.tools = _tools(body.get("tools"))
    req.tool_choice = _tool_choice(body.get("tool_choice"), req.tools)
    parallel = bool_param(body, "parallel_tool_calls")
    if req.tool_choice not in ("none", "auto"):
        if "structured_output" in req.sampling:
            raise bad_param("tool_choice", "a forced tool choice constrains the reply itself: it "
                                           "cannot be combined with another structured output")
        # NOTE: compact JSON (no free whitespace): a model may otherwise pad the calls with
        # whitespace until max_tokens and never close them
        schema = tool_choice_schema(req.tools, req.tool_choice, parallel is not False)
        req.sampling["structured_output"] = ("json_compact", json.dumps(schema, ensure_ascii=False))
    check_tokens(req, "max_completion_tokens")
    return req
