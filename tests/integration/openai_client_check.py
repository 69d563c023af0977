"""The official `openai` Python client against a running fmoe router.

Run by router_test (RouterTest.OfficialOpenAIClient) with the virtual environment that
deploy/test.sh prepares: python openai_client_check.py BASE_URL API_KEY MODEL
Exits 0 when every check passes; prints what failed otherwise.
"""
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

    try:
        client.completions.create(model=model, prompt="x", max_tokens=4, n=2)
        raise AssertionError("n=2 was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "'n'" in str(e), e
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
