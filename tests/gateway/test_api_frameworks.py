"""Agent frameworks against a live gateway, each through its own client code: the OpenAI
Agents SDK (Responses and Chat Completions models), pydantic-ai, instructor, a LangGraph tool
loop and LlamaIndex's OpenAI-like LLM. (The plain ``openai`` client, LangChain's ``ChatOpenAI``
and LiteLLM are in ``tests/gateway/test_api_agents.py``.)

Every framework gets the same tool, a Python function whose signature bounds its arguments
(what each framework turns into the tool's JSON schema). The tiny random models write
nonsense, so each tool call is forced (a named tool choice) and each structured answer is
constrained by its schema; what is tested is that the framework's own loop runs: the tool ran
with arguments that validate, its result went back, and an answer or a validated object came
out.

A framework that cannot be installed next to the project's pinned dependencies is skipped by
its test, which names the conflict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

import openai
import pytest
from pydantic import ConfigDict, Field

from tests.api_harness import LiveGateway, tools_pair_gateway
from tests.gateway.test_api_agents import Person

MODEL = "target"
TOOL_RESULT = '{"temp_c": 12}'

Call = tuple[str, int]


class ClosedPerson(Person):
    """``Person`` with ``additionalProperties: false`` in its schema: a schema that allows
    more properties lets the model add keys until ``max_tokens`` cuts the object short."""

    model_config = ConfigDict(extra="forbid")


def weather_tool(calls: list[Call]) -> Callable[..., str]:
    """``get_weather``, recording each call in ``calls``."""

    def get_weather(
        city: Annotated[str, Field(max_length=8)], days: Annotated[int, Field(ge=1, le=7)]
    ) -> str:
        """The weather in a city."""
        calls.append((city, days))
        return TOOL_RESULT

    return get_weather


def _one_valid_call(calls: list[Call]) -> None:
    assert len(calls) == 1
    city, days = calls[0]
    assert isinstance(city, str) and len(city) <= 8
    assert isinstance(days, int) and 1 <= days <= 7


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    with tools_pair_gateway(tmp_path_factory.mktemp("frameworks")) as live:
        yield live


def _base_url(gateway: LiveGateway) -> str:
    return gateway.base_url + "/v1"


# --- OpenAI Agents SDK -------------------------------------------------------------------

AGENTS_SDK_MISSING = (
    "openai-agents is not installed (the dev extra has it): its releases for openai>=3 "
    "(0.21 on) pin websockets<17, so it cannot join an environment that has websockets 17"
)


def _agents_sdk(gateway: LiveGateway, api: str) -> tuple[Any, Any]:
    """The ``agents`` module and a model of the given API on the gateway."""
    agents = pytest.importorskip("agents", reason=AGENTS_SDK_MISSING)
    agents.set_tracing_disabled(True)  # no trace export to OpenAI's servers
    client = openai.AsyncOpenAI(
        base_url=_base_url(gateway), api_key=gateway.keys["app"], max_retries=0
    )
    if api == "responses":
        return agents, agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    return agents, agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)


def test_openai_agents_sdk_chat_model_runs_a_forced_tool_and_answers(
    gateway: LiveGateway,
) -> None:
    agents, model = _agents_sdk(gateway, "chat_completions")
    calls: list[Call] = []
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        model=model,
        tools=[agents.function_tool(weather_tool(calls))],
        # Forced on the first turn; the SDK resets it after the call (reset_tool_choice).
        model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=80),
    )
    result = agents.Runner.run_sync(agent, "Weather in Bern?", max_turns=3)
    _one_valid_call(calls)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert result.new_items[1].output == TOOL_RESULT
    assert isinstance(result.final_output, str) and result.final_output


def test_openai_agents_sdk_responses_model_runs_a_forced_tool(gateway: LiveGateway) -> None:
    """The Responses model raises on an ``incomplete`` response, and the tiny model's free
    text never ends by itself, so this run stops at the tool: its result is the output."""
    agents, model = _agents_sdk(gateway, "responses")
    calls: list[Call] = []
    agent = agents.Agent(
        name="weather",
        model=model,
        tools=[agents.function_tool(weather_tool(calls))],
        tool_use_behavior="stop_on_first_tool",
        model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=80),
    )
    result = agents.Runner.run_sync(agent, "Weather in Bern?", max_turns=2)
    _one_valid_call(calls)
    assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item"]
    assert result.final_output == TOOL_RESULT


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_sdk_structured_output(gateway: LiveGateway, api: str) -> None:
    agents, model = _agents_sdk(gateway, api)
    agent = agents.Agent(
        name="who",
        model=model,
        output_type=Person,  # a strict JSON schema: text.format / response_format
        model_settings=agents.ModelSettings(max_tokens=120, temperature=0),
    )
    assert isinstance(agents.Runner.run_sync(agent, "Who?", max_turns=1).final_output, Person)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_sdk_forced_tool_then_structured_answer(
    gateway: LiveGateway, api: str
) -> None:
    agents, model = _agents_sdk(gateway, api)
    calls: list[Call] = []
    agent = agents.Agent(
        name="weather",
        model=model,
        tools=[agents.function_tool(weather_tool(calls))],
        output_type=Person,
        # The forced call comes first; the typed answer after it (the gateway sets the
        # response format aside while a call is forced, as OpenAI does).
        model_settings=agents.ModelSettings(
            tool_choice="get_weather", max_tokens=120, temperature=0
        ),
    )
    result = agents.Runner.run_sync(agent, "Who reports the weather in Bern?", max_turns=3)
    _one_valid_call(calls)
    assert isinstance(result.final_output, Person)


# --- pydantic-ai ---------------------------------------------------------------------------


def _pydantic_ai_model(gateway: LiveGateway) -> Any:
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=_base_url(gateway), api_key=gateway.keys["app"])
    return OpenAIChatModel(MODEL, provider=provider)


def test_pydantic_ai_calls_a_forced_tool_then_returns_a_validated_object(
    gateway: LiveGateway,
) -> None:
    from pydantic_ai import Agent, ModelSettings, RunContext
    from pydantic_ai.capabilities import AbstractCapability

    @dataclass
    class WeatherFirst(AbstractCapability[None]):
        """Forces the function tool on the first step and the output tool afterwards
        (pydantic-ai refuses a static choice that forbids its output tool)."""

        def get_model_settings(self) -> Callable[[RunContext[None]], ModelSettings]:
            def settings(ctx: RunContext[None]) -> ModelSettings:
                forced = "get_weather" if ctx.run_step == 1 else "final_result"
                return ModelSettings(tool_choice=[forced])

            return settings

    calls: list[Call] = []
    agent = Agent(
        _pydantic_ai_model(gateway),
        output_type=Person,
        tools=[weather_tool(calls)],
        capabilities=[WeatherFirst()],
        model_settings=ModelSettings(max_tokens=120, temperature=0),
        retries=0,
    )
    result = agent.run_sync("Who reports the weather in Bern?")
    _one_valid_call(calls)
    assert isinstance(result.output, Person)
    tool_names = [
        part.tool_name
        for message in result.all_messages()
        for part in message.parts
        if part.part_kind == "tool-call"
    ]
    assert tool_names == ["get_weather", "final_result"]


def test_pydantic_ai_native_structured_output(gateway: LiveGateway) -> None:
    from pydantic_ai import Agent, ModelSettings, NativeOutput

    agent = Agent(
        _pydantic_ai_model(gateway),
        output_type=NativeOutput(Person),  # response_format: json_schema
        model_settings=ModelSettings(max_tokens=120, temperature=0),
        retries=0,
    )
    assert isinstance(agent.run_sync("Who?").output, Person)


# --- instructor ----------------------------------------------------------------------------

INSTRUCTOR_MISSING = (
    "instructor is not installed: no release resolves with openai 3.x, since instructor 1.17 "
    "pins jiter<0.15 and openai 3.x needs jiter>=0.16"
)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_a_validated_response_model(gateway: LiveGateway, mode: str) -> None:
    instructor = pytest.importorskip("instructor", reason=INSTRUCTOR_MISSING)
    client = instructor.from_openai(
        openai.OpenAI(base_url=_base_url(gateway), api_key=gateway.keys["app"], max_retries=0),
        mode=getattr(instructor.Mode, mode),
    )
    person = client.chat.completions.create(
        model=MODEL,
        response_model=ClosedPerson,
        messages=[{"role": "user", "content": "Who?"}],
        max_tokens=120,
        temperature=0,
        max_retries=0,  # instructor's own retries: the first answer must validate
    )
    assert isinstance(person, ClosedPerson)


# --- LangGraph -----------------------------------------------------------------------------


def test_langgraph_tool_loop_runs_the_forced_tool_and_ends(gateway: LiveGateway) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import StructuredTool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    calls: list[Call] = []
    tool = StructuredTool.from_function(weather_tool(calls))
    chat = ChatOpenAI(
        model=MODEL,
        base_url=_base_url(gateway),
        api_key=gateway.keys["app"],  # type: ignore[arg-type]
        max_tokens=80,  # type: ignore[call-arg]
        temperature=0,
    )

    def agent(state: MessagesState) -> dict[str, Any]:
        answered = any(isinstance(message, ToolMessage) for message in state["messages"])
        choice = "none" if answered else "get_weather"
        model = chat.bind_tools([tool], tool_choice=choice, strict=True)
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([tool]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    final = graph.compile().invoke({"messages": [HumanMessage("Weather in Bern?")]})

    _one_valid_call(calls)
    _, call, result, answer = final["messages"]
    assert isinstance(call, AIMessage) and call.tool_calls[0]["name"] == "get_weather"
    assert isinstance(result, ToolMessage) and result.tool_call_id == call.tool_calls[0]["id"]
    assert result.content == TOOL_RESULT
    assert isinstance(answer, AIMessage) and not answer.tool_calls
    assert isinstance(answer.content, str)


# --- LlamaIndex ----------------------------------------------------------------------------

LLAMA_INDEX_MISSING = (
    "llama-index-llms-openai-like is not installed: no release resolves with this project, "
    "since 0.6 on it needs llama-index-llms-openai, which pins openai<3, and 0.5 and earlier "
    "pin transformers<5 (the engine needs transformers>=5.20)"
)


@pytest.mark.parametrize("is_chat_model", [True, False], ids=["chat", "completion"])
def test_llama_index_openai_like_chat_and_completion(
    gateway: LiveGateway, is_chat_model: bool
) -> None:
    openai_like = pytest.importorskip("llama_index.llms.openai_like", reason=LLAMA_INDEX_MISSING)
    from llama_index.core.llms import ChatMessage

    llm = openai_like.OpenAILike(
        model=MODEL,
        api_base=_base_url(gateway),
        api_key=gateway.keys["app"],
        is_chat_model=is_chat_model,
        context_window=2048,
        max_tokens=8,
        temperature=0,
        max_retries=0,
    )
    text = llm.complete("def add(a, b):").text
    assert isinstance(text, str) and text
    if is_chat_model:
        reply = llm.chat([ChatMessage(role="user", content="Hello?")])
        assert reply.message.role == "assistant" and reply.message.content
    else:  # the legacy endpoint: streamed tokens add up to the whole completion
        pieces = [chunk.delta for chunk in llm.stream_complete("def add(a, b):")]
        assert "".join(pieces) == text
