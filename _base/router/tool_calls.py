"""Tool calls in a chat completion's text: the parsers `--tool-call-parser` names.

A model asked with `tools` writes its calls in its own format; the parser takes them out of the
text the client sees and returns them as OpenAI `tool_calls`:

- `hermes` (Hermes, Qwen 2.5 / 3 templates): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number, text around them kept as content;
- `llama3_json` (Llama 3.1+ templates): the whole reply is one JSON object
  `{"name": ..., "parameters": {...}}` (or several joined by ";"), optionally after
  `<|python_tag|>`.

A request whose `tool_choice` is `required` or names a function is constrained by structured
output instead (`tool_choice_schema`: the reply is a JSON array of {"name", "parameters"}
calls, or the named function's arguments), and read by the parser kinds `required` and
`named`, which hold the whole reply and turn it into calls at the end.

`ToolCallParser.push(text)` takes streamed text and returns what may be shown now and the calls
completed by it; text that may belong to a call is held back until it is known. `finish()`
returns what is left at the end (a call that never closed, or JSON that does not parse, is shown
as text). Arguments go out as a JSON string, as OpenAI sends them.
"""

from __future__ import annotations

import json
import uuid

PARSERS = ("hermes", "llama3_json")  # --tool-call-parser; `required` and `named` are forced choices
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def _call(obj) -> dict | None:
    """An OpenAI tool call from a parsed {"name", "arguments" | "parameters"} object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args}}


def tool_choice_schema(tools: list[dict], choice: str, parallel: bool = True) -> dict:
    """The JSON schema a forced tool choice constrains the reply to: for `required`, an array of
    at least one {"name", "parameters"} call of the given tools (at most one unless `parallel`);
    for "function:<name>", that function's parameters."""
    def params(t: dict) -> dict:
        return t["function"].get("parameters") or {"type": "object"}

    if choice != "required":
        name = choice.removeprefix("function:")
        return params(next(t for t in tools if t["function"]["name"] == name))
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": params(t)}} for t in tools]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
            "items": {"anyOf": calls}}


class ToolCallParser:
    def __init__(self, kind: str, name: str | None = None) -> None:
        """`kind`: one of PARSERS, or `required` / `named` (with the function's `name`)."""
        if kind not in (*PARSERS, "required", "named") or (kind == "named") != (name is not None):
            raise ValueError(f"tool call parser {kind!r}: choose one of {', '.join(PARSERS)}")
        self.kind, self.name = kind, name
        self.held = ""  # text not shown yet: it may be (part of) a call
        self.num_calls = 0
        self._mode: str | None = None  # llama3_json: "json" (a call) or "text", once known

    def push(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        return self._parse(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        return self._parse(final=True)

    def _parse(self, final: bool) -> tuple[str, list[dict]]:
        if self.kind == "hermes":
            return self._hermes(final)
        if self.kind == "llama3_json":
            return self._llama(final)
        return self._forced(final)

    def _forced(self, final: bool) -> tuple[str, list[dict]]:
        """A reply constrained to calls: nothing shown until the end, then the calls (or, cut
        short by max_tokens so that it does not parse, the text)."""
        if not final:
            return "", []
        text, self.held = self.held, ""
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        if self.kind == "named":
            calls = [_call({"name": self.name, "arguments": text.strip()})]
        else:
            calls = [_call(c) for c in value] if isinstance(value, list) else [None]
        if not calls or None in calls:
            return text, []
        self.num_calls += len(calls)
        return "", calls

    def _hermes(self, final: bool) -> tuple[str, list[dict]]:
        shown, calls = "", []
        while True:
            start = self.held.find(_OPEN)
            if start < 0:
                # NOTE: hold back a tail that may be the start of "<tool_call>"
                keep = 0 if final else next((n for n in range(len(_OPEN) - 1, 0, -1)
                                             if self.held.endswith(_OPEN[:n])), 0)
                shown += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                return shown, calls
            end = self.held.find(_CLOSE, start)
            if end < 0:
                shown += self.held[:start]
                self.held = self.held[start:]
                if final:  # never closed: it was text after all
                    shown, self.held = shown + self.held, ""
                return shown, calls
            body = self.held[start + len(_OPEN):end]
            call = None
            try:
                call = _call(json.loads(body))
            except ValueError:
                pass
            shown += self.held[:start]
            if call is None:
                shown += self.held[start:end + len(_CLOSE)]
            else:
                calls.append(call)
                self.num_calls += 1
            self.held = self.held[end + len(_CLOSE):]

    def _llama(self, final: bool) -> tuple[str, list[dict]]:
        if self._mode is None:
            lead = self.held.lstrip()
            if lead.startswith("{") or lead.startswith(_PYTHON_TAG):
                self._mode = "json"  # held to the end: one JSON document
            elif lead and not _PYTHON_TAG.startswith(lead):
                self._mode = "text"
        if self._mode == "json" and final:
            text, self.held = self.held, ""
            calls = []
            for part in text.strip().removeprefix(_PYTHON_TAG).split(";"):
                try:
                    call = _call(json.loads(part))
                except ValueError:
                    call = None
                if call is None:
                    return text, []  # not calls after all: the reply is text
                calls.append(call)
            self.num_calls += len(calls)
            return "", calls
        if self._mode == "text" or final:
            text, self.held = self.held, ""
            return text, []
        return "", []
