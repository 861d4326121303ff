"""Tool calls through our workers (issue 39 item 1): the parsers, the request's checks, the
templates' rendering, and a scripted synthetic worker on 127.0.0.1 answering the official
``openai`` SDK, unary and streamed (the SDK's own stream assembler)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from openai import AsyncOpenAI, BadRequestError
from tiny_workers import one_torch_thread, tiny_worker  # noqa: F401 (autouse)
from transformers.utils.chat_template_utils import render_jinja_template

from server.errors import HTTPError
from server.worker.app import WorkerSettings, start_worker
from server.worker.request import read_request
from server.worker.synthetic import SYNTHETIC_EOS, SYNTHETIC_VOCAB, SyntheticEngine
from server.worker.synthetic_script import Script
from server.worker.tokenizer import ByteTokenizer
from server.worker.tool_calls import HermesStream, Llama3JsonStream, ToolCallStream, parse_tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
TOOLS = [WEATHER, CLOCK]
HERMES_TWO = (
    "I will look.\n<tool_call>\n" + '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
LLAMA_TWO = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich"}}; {"name": "get_time", "parameters": {}}'
PLAIN = "It is sunny in Paris."


def calls_of(events: list[Any]) -> list[tuple[str, Any]]:
    return [(e.name, json.loads(e.arguments)) for e in events if not isinstance(e, str)]


def streamed(cls: type[ToolCallStream], text: str, step: int, **kw: Any) -> tuple[str | None, list[Any]]:
    stream, events = cls(**kw), []
    for i in range(0, len(text), step):
        events += stream.feed(text[i : i + step])
    events += stream.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls = calls_of(events)
    return (None if calls and not content else content), calls


# ------------------------------------------------------------------ parsers


@pytest.mark.parametrize(
    ("cls", "text", "content", "calls"),
    [
        (HermesStream, HERMES_TWO, "I will look.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
        (HermesStream, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None, [("get_time", {})]),
        # malformed JSON inside the tags stays content, tags and all; the good call is still a call
        (HermesStream, 'a <tool_call>{"name": "x", "arguments": {</tool_call> b'
         '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
         'a <tool_call>{"name": "x", "arguments": {</tool_call> b', [("get_time", {})]),
        # JSON that is no call (no name) stays content
        (HermesStream, '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
        # a partial open tag at the end of the output is text
        (HermesStream, "Done. <tool_c", "Done. <tool_c", []),
        # a call the model ended without its closing tag is taken (vLLM takes it too)
        (HermesStream, '<tool_call>\n{"name": "get_time", "arguments": {}}\n', None, [("get_time", {})]),
        (HermesStream, '<tool_call>\n{"name": "get_time", "argu', '<tool_call>\n{"name": "get_time", "argu', []),
        (HermesStream, PLAIN, PLAIN, []),
        (Llama3JsonStream, LLAMA_TWO, None, [("get_weather", {"city": "Zürich"}), ("get_time", {})]),
        (Llama3JsonStream, ' {"name": "get_time", "arguments": {}}', None, [("get_time", {})]),
        (Llama3JsonStream, PLAIN, PLAIN, []),
        (Llama3JsonStream, 'The answer: {"name": "get_time"}', 'The answer: {"name": "get_time"}', []),
        (Llama3JsonStream, '{"result": 4}', '{"result": 4}', []),  # JSON, no call
        (Llama3JsonStream, '{"name": "get_time", "parameters": {', '{"name": "get_time", "parameters": {', []),
        (Llama3JsonStream, '{"name": "get_time", "parameters": {}} and more', "and more", [("get_time", {})]),
    ],
)  # fmt: skip
def test_parsers_whole_and_streamed_in_every_cut(cls, text, content, calls):
    got_content, got = parse_tool_calls(cls(), text)
    assert (got_content, [(c.name, json.loads(c.arguments)) for c in got]) == (content, calls)
    for step in (1, 2, 3, 5, 11, len(text)):  # partial tags and JSON at the end of every delta
        assert streamed(cls, text, step) == (content, calls), step


def test_hermes_holds_back_only_what_may_be_a_tag():
    stream = HermesStream()
    assert stream.feed("Hi <tool") == ["Hi"]  # " <tool" may open a call: held; the space too (see _gate)
    assert stream.feed("box>") == [" <toolbox>"]
    assert stream.finish() == []


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls = parse_tool_calls(HermesStream(parallel=False), HERMES_TWO)
    assert content == "I will look." and [c.name for c in calls] == ["get_weather"]
    assert streamed(Llama3JsonStream, LLAMA_TWO, 4, parallel=False)[1] == [
        ("get_weather", {"city": "Zürich"})
    ]


def test_string_arguments_are_kept_as_sent_when_json():
    _, calls = parse_tool_calls(
        HermesStream(), '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    )
    assert calls[0].arguments == '{"a": 1}'
    content, calls = parse_tool_calls(
        HermesStream(), '<tool_call>{"name": "f", "arguments": "nope"}</tool_call>'
    )
    assert not calls and content


# ------------------------------------------------------------------ the request's checks


def read(body: dict[str, Any], parser: str = "hermes", tokenizer: Any = None):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}
    return read_request(body, "chat", tokenizer=tokenizer or ByteTokenizer(), model_name="tiny",
                        max_context=4096, tool_call_parser=parser)  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": ["get_time"]}, "tools[0]"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, {"type": "function", "function": {"name": "a b"}}]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
         "tools[0].function.description"),
        ({"tool_choice": "auto"}, "tool_choice"),  # without tools
        ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": 3}}}, "tool_choice.function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"messages": [{"role": "tool", "content": "4"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": {}}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]}]},
         "messages[0].tool_calls[0].id"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]},
         "messages[0].tool_calls[0].function.name"),
        ({"messages": [{"role": "user", "content": "x"},
                       {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}]}]},
         "messages[1].tool_calls[0].function.arguments"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 3}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
    ],
)  # fmt: skip
def test_malformed_tools_are_400s_naming_the_field(body, param):
    with pytest.raises(HTTPError) as info:
        read(body)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert param.split(".")[0].split("[")[0] in info.value.message


def test_tools_read_with_the_choice_and_the_parser():
    assert read({}).tools is None
    tools = read({"tools": TOOLS}).tools
    assert (tools.choice, tools.function, tools.parallel, tools.parsing) == ("auto", None, True, True)
    none = {"type": "function", "function": {"name": "none"}}  # a function may be named "none"
    tools = read({"tools": [*TOOLS, none], "parallel_tool_calls": False,
                  "tool_choice": {"type": "function", "function": {"name": "none"}}}).tools  # fmt: skip
    assert (tools.choice, tools.function, tools.parallel, tools.parsing) == ("function", "none", False, True)
    assert not read({"tools": TOOLS, "tool_choice": "none"}).tools.parsing  # none: no parsing
    assert not read({"tools": TOOLS}, parser="none").tools.parsing
    with pytest.raises(HTTPError) as info:  # completions have no tools
        read_request({"model": "tiny", "prompt": "x", "tools": TOOLS}, "completions", tokenizer=ByteTokenizer(),
                     model_name="tiny", max_context=4096)  # fmt: skip
    assert info.value.param == "tools"


# ------------------------------------------------------------------ rendering

CONVERSATION = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sun"},
]  # fmt: skip


def prompt_text(body: dict[str, Any]) -> str:
    tokenizer = ByteTokenizer()
    return tokenizer.decode(read(body, tokenizer=tokenizer).prompt_ids.tolist())


def test_tiny_renders_tools_calls_results_and_developer():
    # was a 400 before: messages[0].role must be one of system, user, assistant
    text = prompt_text({"messages": CONVERSATION, "tools": [CLOCK]})
    assert text == (
        "<|bos|><|system|>Be brief.\n\n# Tools\n" + json.dumps(CLOCK) + "\n"
        'Call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|end|>'
        "<|user|>Weather in Paris?<|end|>"
        '<|assistant|><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|end|>'
        "<|user|><tool_response>18 C, sun</tool_response><|end|><|assistant|>"
    )
    # no system turn: the tools get one of their own; no tools: no block
    alone = prompt_text({"tools": [CLOCK]})
    assert alone.startswith("<|bos|><|system|># Tools\n") and alone.endswith("<|user|>hi<|end|><|assistant|>")
    assert prompt_text({}) == "<|bos|><|user|>hi<|end|><|assistant|>"


QWEN25_STYLE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


def hf_tokenizer(template: str) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from server.worker.hf import HFTokenizer

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return HFTokenizer(backend, chat_template=template, eos_token_ids=[0])


def test_a_qwen25_style_template_renders_tools_as_transformers_does(tmp_path: Path):
    template_file = tmp_path / "chat_template.jinja"
    template_file.write_text(QWEN25_STYLE)
    source = template_file.read_text()
    tokenizer = hf_tokenizer(source)
    rendered: list[str] = []
    render = tokenizer.apply_chat_template
    tokenizer.apply_chat_template = lambda messages, **kw: rendered.append(render(messages, **kw)) or "hi"
    body = {"messages": [{**m, "role": "system"} if m["role"] == "developer" else m for m in CONVERSATION],
            "tools": TOOLS}  # fmt: skip
    req = read(body, tokenizer=tokenizer)
    assert req.tools is not None and req.tools.parsing
    assert body["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # as sent
    # transformers with the arguments as the object they encode (what a template's tojson expects)
    messages = json.loads(json.dumps(body["messages"]))
    messages[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    reference = render_jinja_template(
        [messages], tools=TOOLS, chat_template=source, add_generation_prompt=True
    )
    assert rendered == [reference[0][0]]
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered[0]  # not a quoted string
    assert json.dumps(WEATHER) in rendered[0] and rendered[0].endswith("<|im_start|>assistant\n")


def test_developer_is_system_where_the_template_has_no_developer():
    tokenizer = hf_tokenizer(QWEN25_STYLE)
    developer = tokenizer.apply_chat_template([{"role": "developer", "content": "Be brief."},
                                               {"role": "user", "content": "hi"}])  # fmt: skip
    assert developer.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    own = hf_tokenizer("{% for m in messages %}[{{ m.role }}]{% endfor %}{# developer aware #}")
    assert own.apply_chat_template([{"role": "developer", "content": "x"}]) == "[developer]"


# ------------------------------------------------------------------ a scripted worker, the openai SDK


@contextlib.asynccontextmanager
async def scripted(answers: list[str], parser: str) -> AsyncIterator[AsyncOpenAI]:
    """A synthetic worker on 127.0.0.1 answering ``answers`` in turn, and an SDK client of it."""
    script = Script(answers, eos=SYNTHETIC_EOS, vocab=SYNTHETIC_VOCAB)
    runner, port = await start_worker(SyntheticEngine(0, script=script),
                                      WorkerSettings(model_name="synthetic", tool_call_parser=parser))  # fmt: skip
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    try:
        yield client
    finally:
        await client.close()
        await runner.cleanup()


MESSAGES = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Weather and time?"}]


async def both_ways(client: AsyncOpenAI, **kw: Any) -> tuple[Any, Any, list[Any]]:
    """The unary answer's choice, the SDK's stream assembly of the streamed one, and the chunks."""
    unary = await client.chat.completions.create(model="synthetic", messages=MESSAGES, **kw)
    async with client.chat.completions.stream(model="synthetic", messages=MESSAGES, **kw) as stream:
        chunks = [event.chunk async for event in stream if event.type == "chunk"]
        final = await stream.get_final_completion()
    return unary.choices[0], final.choices[0], chunks


def visible(choice: Any) -> tuple[Any, ...]:
    calls = [
        (c.type, c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or ()
    ]
    return choice.finish_reason, choice.message.content, calls


@pytest.mark.parametrize(
    ("answer", "parser", "content", "calls"),
    [(HERMES_TWO, "hermes", "I will look.",
      [("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]),
     (LLAMA_TWO, "llama3_json", None, [("function", "get_weather", {"city": "Zürich"}), ("function", "get_time", {})])],
)  # fmt: skip
async def test_the_sdk_gets_the_calls_unary_and_streamed(answer, parser, content, calls):
    async with scripted([answer], parser) as client:
        unary, assembled, chunks = await both_ways(client, tools=TOOLS)
    assert visible(unary) == visible(assembled) == ("tool_calls", content, calls)
    assert all(c.id.startswith("call_") for c in unary.message.tool_calls)
    # the stream: each call's index, id, type and name first, then its arguments in fragments
    pieces = [tc for chunk in chunks for choice in chunk.choices for tc in choice.delta.tool_calls or ()]
    for index in (0, 1):
        mine = [p for p in pieces if p.index == index]
        assert mine[0].id and mine[0].type == "function" and mine[0].function.name == calls[index][1]
        assert all(p.id is None and p.function.name is None for p in mine[1:])
        assert json.loads("".join(p.function.arguments or "" for p in mine)) == calls[index][2]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_tool_choice_none_and_no_tools_leave_the_text_alone():
    async with scripted([HERMES_TWO], "hermes") as client:
        for kw in ({}, {"tools": TOOLS, "tool_choice": "none"}):
            unary, assembled, _ = await both_ways(client, **kw)
            assert visible(unary) == visible(assembled) == ("stop", HERMES_TWO, [])


async def test_required_or_named_without_a_call_is_a_plain_answer():
    async with scripted([PLAIN], "hermes") as client:
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            unary, assembled, _ = await both_ways(client, tools=TOOLS, tool_choice=choice)
            assert visible(unary) == visible(assembled) == ("stop", PLAIN, [])
        # (the SDK's stream helper refuses a length finish: the raw stream's chunks then)
        kw = {
            "model": "synthetic",
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": 3,
        }
        unary = (await client.chat.completions.create(**kw)).choices[0]
        assert visible(unary) == ("length", PLAIN[:9], [])
        chunks = [chunk async for chunk in await client.chat.completions.create(**kw, stream=True)]
        deltas = [choice for chunk in chunks for choice in chunk.choices]
        assert "".join(d.delta.content or "" for d in deltas) == PLAIN[:9]
        assert not any(d.delta.tool_calls for d in deltas) and deltas[-1].finish_reason == "length"


async def test_the_stop_string_that_matched_is_the_choices_stop_reason():
    """vLLM's ``stop_reason`` on the finished choice, unary and in the stream's closing chunk (the
    SDK keeps it as an extra member); none where no stop string or stop token ended the answer."""
    async with scripted([PLAIN], "hermes") as client:
        unary, assembled, chunks = await both_ways(client, stop=["zz", "in P"])
        assert visible(unary) == visible(assembled) == ("stop", "It is sunny ", [])
        assert unary.stop_reason == chunks[-1].choices[0].stop_reason == "in P"
        text = await client.completions.create(model="synthetic", prompt="Weather?", stop="Paris")
        assert (text.choices[0].text, text.choices[0].stop_reason) == ("It is sunny in ", "Paris")
        unary, _assembled, chunks = await both_ways(client)
        assert unary.finish_reason == "stop" and not hasattr(unary, "stop_reason")
        assert not any(hasattr(choice, "stop_reason") for chunk in chunks for choice in chunk.choices)


async def test_a_call_round_trip_and_a_malformed_tool_through_the_sdk():
    async with scripted([HERMES_TWO], "hermes") as client:
        await round_trip(client)


async def round_trip(client: AsyncOpenAI) -> None:
    first = await client.chat.completions.create(model="synthetic", messages=MESSAGES, tools=TOOLS,
                                                        parallel_tool_calls=False)  # fmt: skip
    message = first.choices[0].message
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    history = [*MESSAGES, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C"}]  # fmt: skip
    again = await client.chat.completions.create(model="synthetic", messages=history, tools=TOOLS)
    assert again.choices[0].finish_reason == "tool_calls"
    with pytest.raises(BadRequestError) as info:
        await client.chat.completions.create(
            model="synthetic", messages=MESSAGES, tools=[{"type": "function", "function": {"name": "a b"}}]
        )
    assert info.value.status_code == 400 and "tools[0].function.name" in str(info.value)


def test_script_ids_name_their_answer():
    script = Script(["abcdefg", "", "xy"], eos=SYNTHETIC_EOS, vocab=SYNTHETIC_VOCAB)
    assert [script.token(0, p) for p in range(4)] == [1, 2, 3, SYNTHETIC_EOS]
    assert script.token(1, 0) == SYNTHETIC_EOS and script.token(2, 0) == 4
    assert [script.answer_of([]) for _ in range(4)] == [0, 1, 2, 0]
    assert script.answer_of([4]) == 2 and script.answer_of([2]) == 0  # a forced first token's answer
    assert "".join(script.piece(i) for i in (1, 2, 3)) == "abcdefg"
    with pytest.raises(ValueError):
        Script(["x" * 3 * SYNTHETIC_VOCAB], eos=SYNTHETIC_EOS, vocab=SYNTHETIC_VOCAB)


@pytest.mark.parametrize(
    "relay", [{"relay": "fast", "gen_tokids_ctxbytes": True, "gen_strip_message_history": True},
              {"relay": "parsed"}, {"relay": "parsed-msgpack", "gen_tokids_ctxbytes": True}],
)  # fmt: skip
async def test_disaggregated_the_generation_leg_goes_on_with_its_context_legs_answer(relay):
    """A scripted context and generation worker behind an orchestrator: the generation leg continues the
    answer its first token names and parses it; a history with a call and its result passes."""
    from helpers import get

    from server.orchestrator.app import start_server
    from server.orchestrator.config import build_config

    workers = []
    for role in ("context", "generation"):
        script = Script([PLAIN, HERMES_TWO], eos=SYNTHETIC_EOS, vocab=SYNTHETIC_VOCAB)
        settings = WorkerSettings(role=role, model_name="synthetic", tool_call_parser="hermes")
        workers.append(await start_worker(SyntheticEngine(0, script=script), settings))
    (_, ctx_port), (_, gen_port) = workers
    config = build_config({"port": 0, "health_check_interval_s": 0.2, **relay,
                           "context_servers": {"urls": [f"127.0.0.1:{ctx_port}"]},
                           "generation_servers": {"urls": [f"127.0.0.1:{gen_port}"]}}, environ={})  # fmt: skip
    server, _ = await start_server(config)
    port = server.sockets[0].getsockname()[1]
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    try:
        for _ in range(200):
            if (await get(port, "/health")).status == 200:
                break
            await asyncio.sleep(0.05)
        history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]  # fmt: skip
        # The context worker answers the script's texts in turn; the generation worker, whose own turn
        # never moves (its legs all carry a first token), goes on with the answer that token names.
        kw = {"model": "synthetic", "messages": history, "tools": TOOLS}
        unary = [visible((await client.chat.completions.create(**kw)).choices[0]) for _ in range(2)]
        assembled = []
        for _ in range(2):
            async with client.chat.completions.stream(**kw) as stream:
                async for _event in stream:
                    pass
                assembled.append(visible((await stream.get_final_completion()).choices[0]))
        calls = [("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]
        assert unary == assembled == [("stop", PLAIN, []), ("tool_calls", "I will look.", calls)]
    finally:
        await client.close()
        await server.cleanup()
        for runner, _port in workers:
            await runner.cleanup()


async def test_the_tiny_worker_takes_a_tool_conversation():
    """The issue's new user: the built-in model answered a tool or developer message with a 400."""
    worker = await tiny_worker()
    client = AsyncOpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)
    try:
        answer = await client.chat.completions.create(model="tiny", messages=CONVERSATION, tools=[CLOCK],
                                                      max_tokens=4, temperature=0)  # fmt: skip
        expected = ByteTokenizer().encode(prompt_text({"messages": CONVERSATION, "tools": [CLOCK]}),
                                          add_special_tokens=False)  # fmt: skip
        assert answer.usage.prompt_tokens == len(expected)
        assert (
            answer.choices[0].finish_reason in ("stop", "length") and not answer.choices[0].message.tool_calls
        )
    finally:
        await client.close()
        await worker.server.cleanup()


def test_script_files_and_the_parser_setting(tmp_path: Path):
    text = tmp_path / "answer.txt"
    text.write_text(HERMES_TWO)
    assert Script.load(text, eos=SYNTHETIC_EOS, vocab=SYNTHETIC_VOCAB).answers == [HERMES_TWO]
    listed = tmp_path / "answers.json"
    listed.write_text(json.dumps([PLAIN, HERMES_TWO]))
    assert Script.load(listed, eos=SYNTHETIC_EOS, vocab=SYNTHETIC_VOCAB).answers == [PLAIN, HERMES_TWO]
    for bad in ("{", '{"a": 1}', "[]", "[1]"):
        listed.write_text(bad)
        with pytest.raises(ValueError):
            Script.load(listed, eos=SYNTHETIC_EOS, vocab=SYNTHETIC_VOCAB)
    with pytest.raises(ValueError, match="tool_call_parser must be one of none, hermes, llama3_json"):
        WorkerSettings(tool_call_parser="mistral")


def test_hostile_arguments_are_400s_or_text_never_500s():
    def call(arguments: str) -> dict[str, Any]:
        return {"messages": [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]}  # fmt: skip

    where = "messages[0].tool_calls[0].function.arguments"
    for arguments, wording in (("[" * 100_000 + "]" * 100_000, "not valid JSON"),
                               ('{"a": "\\ud800"}', "lone surrogate")):  # fmt: skip
        with pytest.raises(HTTPError) as info:
            read(call(arguments))
        assert (info.value.status, info.value.param) == (400, where) and wording in info.value.message
    deep = '<tool_call>{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>"
    assert parse_tool_calls(HermesStream(), deep) == (deep, [])
    deep = '{"name": "f", "parameters": {"a": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    assert parse_tool_calls(Llama3JsonStream(), deep) == (deep, [])


def test_up_hands_the_parser_and_the_script_to_its_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import argparse

    from server import launcher

    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        launcher.add_arguments(parser)
        return parser.parse_args(list(argv))

    monkeypatch.chdir(tmp_path)
    children = launcher.plan(
        parse("--model", "synthetic", "--tool-call-parser", "hermes", "--script", "a.json")
    )
    workers, orchestrator = children[:-1], children[-1]
    for worker in workers:
        assert worker.argv[worker.argv.index("--tool-call-parser") + 1] == "hermes"
        assert worker.argv[worker.argv.index("--script") + 1] == str(tmp_path / "a.json")
    assert "--script" not in orchestrator.argv and "--tool-call-parser" not in orchestrator.argv
    assert all(
        "--script" not in c.argv and "--tool-call-parser" not in c.argv for c in launcher.plan(parse())
    )
    with pytest.raises(ValueError, match=r"--script .* needs --model synthetic"):
        launcher.plan(parse("--script", "a.json"))


def test_the_worker_command_with_a_script_and_a_parser(tmp_path: Path):
    """``fastcore-serve worker --model synthetic --script FILE --tool-call-parser llama3_json``, port 0,
    and the blocking SDK client, unary and through its stream helper."""
    import re
    import subprocess
    import sys
    import threading

    from openai import OpenAI

    script = tmp_path / "answers.json"
    script.write_text(json.dumps([LLAMA_TWO]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "worker", "--model", "synthetic", "--prompt-tokens", "0",
         "--script", str(script), "--tool-call-parser", "llama3_json", "--port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the bound port, from its start line
            found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if found:
                break
        else:
            raise AssertionError(f"the worker exited with {proc.wait()}")
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # a full pipe would block it
        with OpenAI(base_url=found.group(1) + "/v1", api_key="unused", max_retries=0) as client:
            unary = client.chat.completions.create(model="synthetic", messages=MESSAGES, tools=TOOLS)
            with client.chat.completions.stream(model="synthetic", messages=MESSAGES, tools=TOOLS) as stream:
                assembled = stream.get_final_completion()
        calls = [("function", "get_weather", {"city": "Zürich"}), ("function", "get_time", {})]
        assert visible(unary.choices[0]) == visible(assembled.choices[0]) == ("tool_calls", None, calls)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_finished_answer_streamed_by_the_orchestrator_keeps_its_calls():
    """openai_shapes.answer_stream (a context leg's finished answer, streamed): the calls whole, one chunk
    each, as the SDK's stream state assembles them."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from server import openai_shapes

    calls = [{"id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    answer = openai_shapes.answer_object(chat=True, response_id="chatcmpl-1", created=1, model="m", text=None,
                                         finish_reason="tool_calls", usage=usage, tool_calls=calls)  # fmt: skip
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": None, "tool_calls": calls}
    state = ChatCompletionStreamState()
    for event in openai_shapes.answer_stream(answer, chat=True, include_usage=True).split(b"\n\n"):
        if event.startswith(b"data: {"):
            state.handle_chunk(ChatCompletionChunk.model_validate_json(event[len(b"data: ") :]))
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.model_dump(include={"id", "type", "function"}) for c in choice.message.tool_calls] == [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "get_time", "arguments": "{}", "parsed_arguments": None},
        }
    ]
