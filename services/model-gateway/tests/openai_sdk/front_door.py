"""The official `openai` Python SDK against the gateway's HTTP front door.

Run by tests/openai_front_door.rs: argv = base_url api_key. Prints `ok <case>` per passed case
and exits non-zero on the first failure (an AssertionError or an unexpected SDK exception).
"""
import json
import sys

import openai

base_url, key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=20)


def ok(case):
    print("ok", case, flush=True)


# Models: every declared model and `default`.
ids = {m.id for m in client.models.list()}
assert {"scripted", "eyes", "m", "default"} <= ids, ids
ok("models")

# Non-streamed text.
resp = client.chat.completions.create(
    model="scripted", messages=[{"role": "user", "content": "hello there"}]
)
text = resp.choices[0].message.content
assert text == "(offline) you said: hello there", text
assert resp.choices[0].finish_reason == "stop"
assert resp.usage.total_tokens > 0
ok("non_stream")

# Streamed text: the deltas add up to the same answer; usage arrives last when asked.
pieces, usage, finish = [], None, None
for chunk in client.chat.completions.create(
    model="scripted",
    messages=[{"role": "user", "content": "hello there"}],
    stream=True,
    stream_options={"include_usage": True},
):
    if chunk.usage is not None:
        usage = chunk.usage
    for choice in chunk.choices:
        if choice.delta.content:
            pieces.append(choice.delta.content)
        if choice.finish_reason:
            finish = choice.finish_reason
assert len(pieces) > 1, pieces
assert "".join(pieces) == text, pieces
assert finish == "stop", finish
assert usage is not None and usage.total_tokens == resp.usage.total_tokens, usage
ok("stream_text")

# Streamed tool call, assembled the way SDK users do.
tools = [{"type": "function", "function": {"name": "get_time", "description": "now",
          "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}]
calls, finish = {}, None
for chunk in client.chat.completions.create(
    model="scripted",
    messages=[{"role": "user", "content": "what time is it?"}],
    tools=tools,
    tool_choice="auto",
    stream=True,
):
    for choice in chunk.choices:
        for tc in choice.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": "", "name": "", "args": ""})
            entry["id"] += tc.id or ""
            if tc.function:
                entry["name"] += tc.function.name or ""
                entry["args"] += tc.function.arguments or ""
        if choice.finish_reason:
            finish = choice.finish_reason
assert finish == "tool_calls", finish
assert list(calls) == [0], calls
assert calls[0]["name"] == "get_time" and calls[0]["id"], calls
assert json.loads(calls[0]["args"]) == {"tz": "UTC"}, calls
ok("stream_tool_call")

# Non-streamed tool round trip: the call, then the answer from its result.
first = client.chat.completions.create(
    model="scripted", messages=[{"role": "user", "content": "what time is it?"}], tools=tools
)
call = first.choices[0].message.tool_calls[0]
assert first.choices[0].finish_reason == "tool_calls"
assert json.loads(call.function.arguments) == {"tz": "UTC"}
second = client.chat.completions.create(
    model="scripted",
    tools=tools,
    messages=[
        {"role": "user", "content": "what time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ],
)
assert second.choices[0].message.content == "It is 12:00.", second
ok("tool_round_trip")

# An image goes to a vision model.
png = "data:image/png;base64,iVBORw0KGgo="
resp = client.chat.completions.create(
    model="eyes",
    messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": png}}]}],
)
assert resp.choices[0].message.content == "(offline) you said: what is this"
ok("image")

# reasoning_effort reaches the upstream provider (checked by the Rust side).
resp = client.chat.completions.create(
    model="m", messages=[{"role": "user", "content": "think"}], reasoning_effort="high"
)
assert resp.choices[0].message.content == "from upstream"
assert resp.usage.prompt_tokens_details.cached_tokens == 3
ok("reasoning_effort")

# Errors: the SDK's own exception classes, from the HTTP status and OpenAI's error JSON.
try:
    client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    raise AssertionError("unknown model accepted")
except openai.NotFoundError as e:
    assert e.status_code == 404 and "nope" in e.message, e
ok("error_404")

try:
    client.chat.completions.create(model="down", messages=[{"role": "user", "content": "x"}])
    raise AssertionError("a failing provider answered")
except openai.APIStatusError as e:
    assert e.status_code == 503, e
    assert e.body["code"] == "unavailable", e.body
ok("error_503")

try:
    client.chat.completions.create(
        model="down", messages=[{"role": "user", "content": "x"}], stream=True
    )
    raise AssertionError("a failing provider streamed")
except openai.APIStatusError as e:
    assert e.status_code == 503, e
ok("error_503_stream")

try:
    client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "x"}], extra_body={"top_q": 1}
    )
    raise AssertionError("an unknown field was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and "top_q" in e.message, e
ok("error_400")

bad = openai.OpenAI(base_url=base_url, api_key="wrong-key", max_retries=0)
try:
    bad.models.list()
    raise AssertionError("a wrong key was accepted")
except openai.AuthenticationError as e:
    assert e.status_code == 401, e
ok("error_401")
