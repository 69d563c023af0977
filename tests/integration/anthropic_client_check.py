"""The official `anthropic` Python client against a running fmoe router's POST /v1/messages.

Run by router_test (RouterTest.OfficialAnthropicClient) with the virtual environment that
deploy/test.sh prepares: python anthropic_client_check.py BASE_URL API_KEY MODEL
Exits 0 when every check passes; prints what failed otherwise.
"""
import sys

import anthropic


def main() -> int:
    base_url, api_key, model = sys.argv[1], sys.argv[2], sys.argv[3]
    client = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0)

    # Greedy through extra_body: the client's own temperature argument is gone in its 2.x.
    greedy = {"temperature": 0}
    whole = client.messages.create(model=model, max_tokens=8, extra_body=greedy,
                                   system="Be brief.",
                                   messages=[{"role": "user", "content": "Who made the earth?"}])
    assert whole.type == "message" and whole.role == "assistant", whole
    assert whole.content and whole.content[0].type == "text" and whole.content[0].text, whole
    assert whole.stop_reason in ("end_turn", "max_tokens"), whole
    assert 0 < whole.usage.output_tokens <= 8 and whole.usage.input_tokens > 0, whole

    # The stream's events, through the client's own accumulation, give the same message.
    with client.messages.stream(model=model, max_tokens=8, extra_body=greedy, system="Be brief.",
                                messages=[{"role": "user", "content": "Who made the earth?"}]
                                ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text, (text, whole)
    assert final.stop_reason == whole.stop_reason, final
    assert final.usage.output_tokens == whole.usage.output_tokens, final

    # A stop sequence taken from the greedy answer ends it there.
    words = whole.content[0].text.split()
    if len(words) >= 2:
        stop = " " + words[1]
        cut = client.messages.create(model=model, max_tokens=8, extra_body=greedy,
                                     system="Be brief.",
                                     stop_sequences=[stop],
                                     messages=[{"role": "user", "content": "Who made the earth?"}])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop, cut
        assert stop not in (cut.content[0].text if cut.content else ""), cut

    # Tools and a history holding a tool_use and its tool_result (the tiny model writes no
    # calls: the answer is text).
    tools = [{"name": "get_weather", "description": "The weather in a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}]
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": [
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                    "input": {"city": "Paris"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "22 C"}]}]
    after = client.messages.create(model=model, max_tokens=6, extra_body=greedy, tools=tools,
                                   messages=history)
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use"), after

    # tool_choice any / tool decode under the tool's schema: the call always parses. The
    # city's length is bounded so that the tiny model's answer completes.
    short = [dict(tools[0], input_schema={
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"]})]
    for choice in ({"type": "any"}, {"type": "tool", "name": tools[0]["name"]}):
        forced = client.messages.create(model=model, max_tokens=400, extra_body=greedy,
                                        tools=short, tool_choice=choice, messages=history)
        uses = [b for b in forced.content if b.type == "tool_use"]
        assert uses and uses[0].name == tools[0]["name"], forced
        assert set(uses[0].input) == {"city"} and isinstance(uses[0].input["city"], str), forced
    bad_key = anthropic.Anthropic(base_url=base_url, api_key="wrong-key-0000", max_retries=0)
    try:
        bad_key.messages.create(model=model, max_tokens=4,
                                messages=[{"role": "user", "content": "x"}])
        raise AssertionError("a wrong key was accepted")
    except anthropic.AuthenticationError as e:
        assert e.status_code == 401, e
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
