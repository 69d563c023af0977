"""The official `openai` Python client against a running fmoe router.

Run by router_test (RouterTest.OfficialOpenAIClient) with the virtual environment that
deploy/test.sh prepares: python openai_client_check.py BASE_URL API_KEY MODEL
Exits 0 when every check passes; prints what failed otherwise.
"""
import json
import re
import sys

import openai


def main() -> int:
    base_url, api_key, model = sys.argv[1], sys.argv[2], sys.argv[3]
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)

    models = client.models.list()
    assert [m.id for m in models.data] == [model], models

    whole = client.completions.create(model=model, prompt="In the beginning", max_tokens=8,
                                      temperature=0)
    assert whole.object == "text_completion", whole
    assert len(whole.choices) == 1 and whole.choices[0].text, whole
    assert whole.choices[0].finish_reason in ("stop", "length"), whole
    assert whole.usage.completion_tokens <= 8 and whole.usage.prompt_tokens > 0, whole

    pieces = []
    finish = None
    usage = None
    for chunk in client.completions.create(model=model, prompt="In the beginning", max_tokens=8,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].text, (pieces, whole.choices[0].text)
    assert finish == whole.choices[0].finish_reason, finish
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens, usage

    chat = client.chat.completions.create(
        model=model, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Who made the earth?"}])
    assert chat.object == "chat.completion", chat
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content, chat
    deltas = []
    for chunk in client.chat.completions.create(
            model=model, max_tokens=8, temperature=0, stream=True,
            messages=[{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Who made the earth?"}]):
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
    assert "".join(deltas) == chat.choices[0].message.content, (deltas, chat)

    # Tools: the client's tools, a history with a call and its result, streamed too; the tiny
    # model writes no calls, so the answers are text, in the shapes the client parses.
    assert client.models.retrieve(model).id == model
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"}]
    with_tools = client.chat.completions.create(model=model, max_tokens=6, temperature=0,
                                                tools=tools, messages=history)
    assert with_tools.choices[0].finish_reason in ("stop", "length", "tool_calls"), with_tools
    streamed_tools = list(client.chat.completions.create(
        model=model, max_tokens=6, temperature=0, tools=tools, tool_choice="auto", stream=True,
        messages=history))
    text = "".join(c.choices[0].delta.content or "" for c in streamed_tools if c.choices)
    assert text == (with_tools.choices[0].message.content or ""), (text, with_tools)
    # tool_choice by name and "required" decode under the tool's schema (structured output), so
    # even the tiny model's calls parse; its strings are bounded so that the answer completes.
    short = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"]}}}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        forced = client.chat.completions.create(model=model, max_tokens=400, temperature=0,
                                                tools=short, tool_choice=choice,
                                                messages=history)
        calls = forced.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather", forced
        args = json.loads(calls[0].function.arguments)
        assert set(args) == {"city"} and isinstance(args["city"], str), args
    try:
        client.chat.completions.create(
            model=model, max_tokens=4, tools=tools, messages=history,
            tool_choice={"type": "function", "function": {"name": "no_such_tool"}})
        raise AssertionError("a named tool_choice that is not in tools was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "tool_choice" in str(e), e

    # response_format json_schema: the answer is JSON that validates.
    schema = {"type": "object",
              "properties": {"answer": {"type": "string", "maxLength": 10},
                             "confidence": {"type": "integer"}},
              "required": ["answer", "confidence"]}
    structured = client.chat.completions.create(
        model=model, max_tokens=400, temperature=0,
        messages=[{"role": "user", "content": "Who made the earth?"}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "Answer", "schema": schema, "strict": True}})
    value = json.loads(structured.choices[0].message.content)
    assert set(value) == {"answer", "confidence"}, value
    assert isinstance(value["answer"], str) and isinstance(value["confidence"], int), value
    try:
        client.chat.completions.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "A", "schema": {"type": "string", "pattern": "^a"}}})
        raise AssertionError("a schema with pattern was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "pattern" in str(e), e

    # vLLM's guided decoding through the client's extra_body: a choice, a regex and a GBNF
    # grammar (the legacy guided_* names and structured_outputs), whole and streamed, on chat
    # and on completions; a bad regex and two constraints at once are 400s naming the field.
    ask = [{"role": "user", "content": "Is the earth round?"}]
    colours = ["red", "green", "blue violet"]
    picked = client.chat.completions.create(model=model, max_tokens=16, temperature=0,
                                            messages=ask, extra_body={"guided_choice": colours})
    assert picked.choices[0].message.content in colours, picked
    assert picked.choices[0].finish_reason == "stop", picked
    streamed_pick = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, max_tokens=16, temperature=0, messages=ask, stream=True,
            extra_body={"guided_choice": colours}) if c.choices)
    assert streamed_pick == picked.choices[0].message.content, (streamed_pick, picked)
    sampled = client.chat.completions.create(
        model=model, max_tokens=16, temperature=1.0, seed=5, n=3, messages=ask,
        extra_body={"structured_outputs": {"choice": colours}})
    assert all(c.message.content in colours for c in sampled.choices), sampled
    code = client.completions.create(model=model, prompt="The code is", max_tokens=32,
                                     temperature=0.8, seed=2,
                                     extra_body={"guided_regex": "[0-9]{3}-[a-z]{2,4}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", code.choices[0].text), code
    assert code.choices[0].finish_reason == "stop", code
    gbnf = 'root ::= animal " and " animal\nanimal ::= "cat" | "dog" | "owl"'
    pair = client.chat.completions.create(
        model=model, max_tokens=32, temperature=0.7, seed=9, messages=ask,
        extra_body={"structured_outputs": {"grammar": gbnf}})
    assert re.fullmatch("(cat|dog|owl) and (cat|dog|owl)", pair.choices[0].message.content), pair
    for extra, field in (({"guided_regex": "[0-9"}, "guided_regex"),
                         ({"guided_choice": colours, "guided_regex": "a+"}, "guided_")):
        try:
            client.chat.completions.create(model=model, max_tokens=4, messages=ask,
                                           extra_body=extra)
            raise AssertionError(f"{extra} was accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and field in str(e), (extra, e)

    # The Responses API: whole, streamed through the client's event handling, and a second turn
    # by previous_response_id.
    first = client.responses.create(model=model, input="Who made the earth?",
                                    instructions="Be brief.", max_output_tokens=8, temperature=0)
    assert first.object == "response" and first.status in ("completed", "incomplete"), first
    assert first.output_text, first
    assert first.usage.output_tokens > 0 and first.usage.input_tokens > 0, first
    # (A response cut by max_output_tokens ends with response.incomplete, as OpenAI's does.)
    streamed, final = "", None
    for event in client.responses.create(model=model, input="Who made the earth?",
                                         instructions="Be brief.", max_output_tokens=8,
                                         temperature=0, stream=True):
        if event.type == "response.output_text.delta":
            streamed += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None and final.status == first.status, final
    assert streamed == first.output_text == final.output_text, (streamed, first, final)
    second = client.responses.create(model=model, input="And then?", max_output_tokens=4,
                                     temperature=0, previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.usage.input_tokens > \
        first.usage.input_tokens, second
    try:
        client.responses.create(model=model, input="x", previous_response_id="resp_unknown")
        raise AssertionError("an unknown previous_response_id was accepted")
    except openai.NotFoundError as e:
        assert e.status_code == 404, e

    # n: independent choices; with a seed, choice i is the request with seed + i.
    many = client.completions.create(model=model, prompt="In the beginning", max_tokens=6,
                                     temperature=1.5, seed=11, n=2)
    assert [c.index for c in many.choices] == [0, 1], many
    for i, choice in enumerate(many.choices):
        one = client.completions.create(model=model, prompt="In the beginning", max_tokens=6,
                                        temperature=1.5, seed=11 + i)
        assert choice.text == one.choices[0].text, (i, choice, one)
    chats = client.chat.completions.create(
        model=model, max_tokens=4, temperature=1.2, seed=3, n=2,
        messages=[{"role": "user", "content": "Who made the earth?"}])
    assert len(chats.choices) == 2, chats

    # logprobs: completions' integer form and chat's boolean + top_logprobs.
    lp = client.completions.create(model=model, prompt="In the beginning", max_tokens=5,
                                   temperature=0, logprobs=2)
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == lp.usage.completion_tokens, lp
    assert all(v <= 0 for v in logprobs.token_logprobs), logprobs
    assert all(len(t) <= 2 for t in logprobs.top_logprobs), logprobs
    assert "".join(logprobs.tokens) == lp.choices[0].text, logprobs
    chat_lp = client.chat.completions.create(
        model=model, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
        messages=[{"role": "user", "content": "Who made the earth?"}])
    content = chat_lp.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 for t in content), chat_lp
    assert all(t.bytes is not None for t in content), chat_lp

    # Penalties and the extensions vLLM takes through extra_body change the output.
    # (Greedy text that repeats itself: the penalties have something to change.)
    base = client.completions.create(model=model, prompt="The city of", max_tokens=24,
                                     temperature=0)
    penalized = client.completions.create(model=model, prompt="The city of", max_tokens=24,
                                          temperature=0, frequency_penalty=2.0,
                                          presence_penalty=1.0)
    assert penalized.choices[0].text != base.choices[0].text, (base, penalized)
    ignored = client.completions.create(model=model, prompt="In the beginning", max_tokens=5,
                                        temperature=0, logit_bias={"2": 100},
                                        extra_body={"ignore_eos": True})
    assert ignored.usage.completion_tokens == 5, ignored

    # Chat without max_tokens may use the rest of the context (not OpenAI's 16): a message of
    # about 950 tokens leaves some 60 of the tiny model's 1024.
    long_chat = client.chat.completions.create(
        model=model, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "a " * 950}])
    assert long_chat.usage.completion_tokens > 16, long_chat.usage
    assert long_chat.usage.total_tokens == 1024, long_chat.usage
    assert long_chat.choices[0].finish_reason == "length", long_chat

    try:
        client.completions.create(model=model, prompt="x", max_tokens=4, best_of=2)
        raise AssertionError("best_of=2 was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "best_of" in str(e), e
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=4)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert e.status_code == 404, e
    bad_key = openai.OpenAI(base_url=base_url, api_key="wrong-key-0000", max_retries=0)
    try:
        bad_key.completions.create(model=model, prompt="x", max_tokens=4)
        raise AssertionError("a wrong key was accepted")
    except openai.AuthenticationError as e:
        assert e.status_code == 401, e
    print("openai client: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
