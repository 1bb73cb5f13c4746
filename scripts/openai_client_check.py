#!/usr/bin/env python3
"""Checks a running `deltamoe serve` with the official openai Python client: models, chat
(JSON and streamed), text completions, a tool-call round trip and error mapping.

    python3 scripts/openai_client_check.py --base-url http://127.0.0.1:8080/v1 [--model NAME]
"""

import argparse
import sys

import openai
from openai import OpenAI

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}]


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"ok: {what}")


def chat(client, model):
    messages = [{"role": "user", "content": "Tell me about the weather."}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    text = reply.choices[0].message.content
    check(isinstance(text, str), "chat returns text")
    check(reply.usage.completion_tokens >= 1, "chat reports usage")
    check(reply.choices[0].finish_reason in ("stop", "length"), "chat finish_reason")
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
    check("".join(parts) == text, "streamed chat equals the JSON reply")
    check(usage is not None and usage.completion_tokens == reply.usage.completion_tokens,
          "streamed usage")


def completions(client, model):
    reply = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0)
    check(isinstance(reply.choices[0].text, str), "completion returns text")
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True)
        if c.choices)
    check(streamed == reply.choices[0].text, "streamed completion equals the JSON reply")


def tool_round_trip(client, model):
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                           max_tokens=6, temperature=0)
    message = reply.choices[0].message
    check(message.role == "assistant", "tool round trip answers")
    for call in message.tool_calls or []:
        check(call.type == "function" and call.function.name, "tool call shape")


def errors(client, model):
    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
        check(False, "unknown model fails")
    except openai.NotFoundError as e:
        check(e.status_code == 404 and e.code == "model_not_found", "unknown model is a 404")
    try:
        client.completions.create(model=model, prompt="hi", max_tokens=10_000_000)
        check(False, "too long fails")
    except openai.BadRequestError as e:
        check(e.code == "context_length_exceeded", "too long is a 400 context_length_exceeded")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=60)
    models = client.models.list().data
    check(len(models) == 1, "one model listed")
    model = args.model or models[0].id
    chat(client, model)
    completions(client, model)
    tool_round_trip(client, model)
    errors(client, model)
    print("openai client check passed")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
