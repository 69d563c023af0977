"""LangChain's OpenAI chat model (`langchain-openai`) against a running fmoe router.

Run by router_test (RouterTest.LangChainClient) with the virtual environment that deploy/test.sh
prepares: python langchain_client_check.py BASE_URL API_KEY MODEL
Checks what LangChain users call: `invoke` and `stream`, `bind_tools` (a named tool, `required`,
and a call streamed in pieces), and `with_structured_output` by json_schema and by function
calling. The tiny model writes no calls of its own; a forced call decodes under the tool's schema
(structured output), so its arguments always parse. Exits 0 when every check passes.
"""
import sys

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str = Field(description="The city", max_length=12)


class Answer(BaseModel):
    """An answer and how sure it is."""

    answer: str = Field(max_length=10)
    confidence: int


def main() -> int:
    base_url, api_key, model = sys.argv[1], sys.argv[2], sys.argv[3]
    llm = ChatOpenAI(base_url=base_url, api_key=api_key, model=model, temperature=0,
                     max_tokens=8, max_retries=0)
    ask = [SystemMessage("Be brief."), HumanMessage("Who made the earth?")]

    whole = llm.invoke(ask)
    assert isinstance(whole, AIMessage) and isinstance(whole.content, str) and whole.content, whole
    assert whole.response_metadata.get("finish_reason") in ("stop", "length"), whole
    assert whole.usage_metadata and 0 < whole.usage_metadata["output_tokens"] <= 8, whole
    streamed = "".join(chunk.content for chunk in llm.stream(ask))
    assert streamed == whole.content, (streamed, whole.content)

    # bind_tools: a named tool and "required" force a call that parses into LangChain's
    # tool_calls (never invalid_tool_calls); the call streamed in pieces adds up to the same.
    long = ChatOpenAI(base_url=base_url, api_key=api_key, model=model, temperature=0,
                      max_tokens=400, max_retries=0)
    question = [HumanMessage("Weather in Paris?")]
    calls = {}
    for choice in ("GetWeather", "required"):
        msg = long.bind_tools([GetWeather], tool_choice=choice).invoke(question)
        assert not msg.invalid_tool_calls, msg
        assert len(msg.tool_calls) >= 1 and msg.tool_calls[0]["name"] == "GetWeather", msg
        args = msg.tool_calls[0]["args"]
        assert set(args) == {"city"} and isinstance(args["city"], str), args
        assert len(args["city"]) <= 12, args
        # A named tool's call ends with "stop", as OpenAI's does; "required" with "tool_calls".
        want = "stop" if choice == "GetWeather" else "tool_calls"
        assert msg.response_metadata.get("finish_reason") == want, msg
        calls[choice] = msg
    merged = None
    for chunk in long.bind_tools([GetWeather], tool_choice="GetWeather").stream(question):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and not merged.invalid_tool_calls, merged
    assert [c["args"] for c in merged.tool_calls] == \
        [c["args"] for c in calls["GetWeather"].tool_calls], (merged, calls["GetWeather"])

    # A history with a call and its result goes back as the client writes it.
    call = calls["GetWeather"].tool_calls[0]
    after = llm.bind_tools([GetWeather]).invoke(
        question + [calls["GetWeather"], ToolMessage("22 C and sunny", tool_call_id=call["id"])])
    assert isinstance(after, AIMessage), after

    # with_structured_output: a validated pydantic object, by json_schema (strict) and by a
    # forced function call; include_raw keeps the parse error, which must be None.
    for method in ("json_schema", "function_calling"):
        structured = long.with_structured_output(Answer, method=method, include_raw=True)
        out = structured.invoke([HumanMessage("Who made the earth?")])
        assert out["parsing_error"] is None, (method, out)
        parsed = out["parsed"]
        assert isinstance(parsed, Answer), (method, out)
        assert len(parsed.answer) <= 10, (method, parsed)

    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
