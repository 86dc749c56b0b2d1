#!/usr/bin/env python3
"""Writes tests/tokenizer/data/jinja_cases.jsonl: small Jinja templates rendered by jinja2 with the environment
transformers uses for chat templates (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols,
its tojson / raise_exception), so the C++ interpreter is checked construct by construct.
Each line: {"template": ..., "context": {...}, "output": ...} or {..., "error": "ExceptionType: message"}.
Runs wherever jinja2 is installed (Debian's python3-jinja2 is enough).
"""
import json
import sys

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
ENV.filters["tojson"] = tojson
ENV.globals["raise_exception"] = raise_exception

MSGS = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "¿Qué tal? 日本"}]
CASES = [
    # whitespace control: trim_blocks, lstrip_blocks, '-' and '+'
    ("{% if true %}\nA\n{% endif %}\nB", {}),
    ("  {% if true %}\n  A\n  {% endif %}\n", {}),
    ("x  {% if true %}y{% endif %}  z", {}),
    ("a\n    {% for i in [1,2] %}\n    {{ i }}\n    {% endfor %}\nb", {}),
    ("a  {%- if true -%}  b  {%- endif -%}  c", {}),
    ("a  {{- 'b' -}}  c\n", {}),
    ("a\n  {%+ if true %}b{% endif %}", {}),
    ("{% if true +%}\nkeep newline{% endif %}", {}),
    ("line\n  {# comment #}\nnext", {}),
    ("a {#- c -#} b", {}),
    ("{% raw %}{{ x }}{% endraw %}\n{%- raw -%}  {% y %}  {%- endraw %}", {}),
    ("trailing newline dropped\n", {}),
    ("two trailing\n\n", {}),
    ("crlf\r\nlines\r\n{% if true %}\r\nx{% endif %}", {}),
    ("{{ 'a' }}\n{{ 'b' }}\n", {}),
    ("{%- for m in messages %}\n<{{ m.role }}>\n{%- endfor %}", {"messages": MSGS}),
    # expressions and operators
    ("{{ 1 + 2 * 3 }} {{ 2 ** 3 ** 2 }} {{ -2 ** 2 }} {{ 7 // -2 }} {{ -7 % 3 }} {{ 7.5 // 2 }} {{ 1 / 3 }}", {}),
    ("{{ 'a' ~ 'b' ~ 3 }} {{ 'ab' * 2 }} {{ [1] * 3 }} {{ 'x' + 'y' }} {{ [1, 2] + [3] }} {{ (1,) }} {{ () }}", {}),
    ("{{ 1 < 2 < 3 }} {{ 3 > 2 > 5 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 1 == 1.0 }} {{ true == 1 }}", {}),
    ("{{ not true }} {{ not 0 and 1 }} {{ 0 or 'x' }} {{ '' or none }} {{ 1 and 2 }} {{ none is none }}", {}),
    ("{{ 'ell' in 'hello' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }}", {}),
    ("{{ x if x else 'no' }} {{ 'yes' if 1 }}|{{ 'yes' if 0 }}|", {"x": 0}),
    ("{{ 1e3 }} {{ 1.5e-7 }} {{ 123456789012345678.0 }} {{ 0.1 * 3 }} {{ 1_000 }} {{ 2.0 }} {{ -0.0 }}", {}),
    ("{{ 'tab\\there' }} {{ \"q'uote\" }} {{ 'uni\\u00e9' }} {{ 'a' 'b' }}", {}),
    ("{{ none }} {{ true }} {{ [none, true, 'x', 1.0] }} {{ {'a': [1, {'b': none}]} }} {{ ('t', 1) }}", {}),
    ("{{ \"it's\" }} {{ ['it\\'s', 'say \"x\"', 'both \\' \"'] }} {{ ['\\n\\t\\x01', 'é'] }}", {}),
    # subscripts, slices, attributes
    ("{{ s[0] }}{{ s[-1] }} {{ s[1:3] }} {{ s[::-1] }} {{ s[::2] }} {{ s[-3:] }} {{ s[10:] }}|", {"s": "héllo世界"}),
    ("{{ l[1:] }} {{ l[:-1] }} {{ l[::-1] }} {{ l[5] }}|{{ l[-1] }} {{ l.0 }}", {"l": [1, 2, 3]}),
    ("{{ d.a }} {{ d['a'] }} {{ d.missing }}|{{ d.items() | list }} {{ d.get('b', 'dflt') }} {{ d.keys() | list }}",
     {"d": {"a": 1}}),
    ("{{ m.content.strip() }}|{{ m.content.split() }}|{{ m.content.split('l', 1) }}|{{ 'a,b'.rsplit(',', 1) }}",
     {"m": {"content": "  hello world  "}}),
    ("{{ 'x'.upper() }} {{ 'Hello World'.lower() }} {{ 'abc'.replace('b', 'X') }} {{ 'a-b'.title() }} "
     "{{ 'hello world'.capitalize() }} {{ '  x '.lstrip() }}| {{ 'xxhixx'.strip('x') }} {{ 'abc'.find('c') }} "
     "{{ '{} and {}'.format(1, 'two') }} {{ 'a\\nb'.splitlines() }} {{ '12'.isdigit() }} {{ ','.join(['a', 'b']) }}", {}),
    # filters
    ("{{ '  x  ' | trim }}|{{ 'xxaxx' | trim('x') }}|{{ [1, 2] | length }} {{ 'héllo' | length }} {{ {} | count }}", {}),
    ("{{ [3, 1, 2] | sort }} {{ ['b', 'A', 'c'] | sort }} {{ ['b', 'A'] | sort(case_sensitive=true) }} "
     "{{ [{'n': 2}, {'n': 1}] | sort(attribute='n') | map(attribute='n') | list }}", {}),
    ("{{ [1, 2, 2, 'a', 'A'] | unique | list }} {{ [1, 5, 3] | max }} {{ [1, 5, 3] | min }} {{ [1, 2] | sum }} "
     "{{ [{'x': 1}, {'x': 2}] | sum(attribute='x') }}", {}),
    ("{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | join(' / ') }}",
     {"messages": MSGS}),
    ("{{ messages | rejectattr('role', 'in', ['system', 'user']) | list | length }} "
     "{{ messages | map(attribute='role') | unique | list }} {{ messages | selectattr('missing') | list }}",
     {"messages": MSGS}),
    ("{{ [0, 1, 2, 3] | select('odd') | list }} {{ [0, 1, '', 'a'] | select | list }} "
     "{{ [1, 2, 3] | reject('gt', 1) | list }} {{ ['a', 'b'] | map('upper') | list }}", {}),
    ("{{ x | default('d') }} {{ '' | default('d') }} {{ '' | default('d', true) }} {{ none | d('n') }}", {}),
    ("{{ 'hello WORLD' | title }} {{ 'hello WORLD' | capitalize }} {{ 'ab' | upper }} {{ 'AB' | lower }} "
     "{{ 'a-b c(d' | title }}", {}),
    ("{{ [1, 2, 3] | first }} {{ [1, 2, 3] | last }} {{ 'abc' | first }} {{ [1, 2] | reverse | list }} "
     "{{ 'abc' | reverse }} {{ 'abc' | list }}", {}),
    ("{{ '3' | int + 1 }} {{ '3.7' | int }} {{ 'x' | int(7) }} {{ '2.5' | float }} {{ 3 | float }} {{ 3.9 | int }}"
     " {{ -2 | abs }} {{ 2.5 | round }} {{ 3.5 | round }} {{ 2.675 | round(2) }} {{ 2.1 | round(0, 'ceil') }}", {}),
    ("{{ d | tojson }} {{ d | tojson(indent=2) }} {{ [1, 'é', none, true, 1.5] | tojson }} "
     "{{ d | tojson(sort_keys=true) }} {{ 'a\"b\\\\c\\n\\u0001' | tojson }} {{ {} | tojson(indent=2) }}",
     {"d": {"z": [1, {"y": []}], "a": "<&>"}}),
    ("{{ d | items | list }} {% for k, v in d | dictsort %}{{ k }}={{ v }};{% endfor %} "
     "{{ d | dictsort(reverse=true) }}", {"d": {"b": 1, "a": 2, "C": 3}}),
    ("{{ 'a\\nb' | indent(2) }}|{{ 'a\\nb' | indent(2, true) }}|{{ 'a b  c' | wordcount }}|{{ 'x' | center(5) }}|", {}),
    ("{{ 'aXbXc' | replace('X', '-') }} {{ 'aaa' | replace('a', 'b', 2) }} {{ 5 | string ~ '!' }} "
     "{{ ['x', 'y'] | join }} {{ [{'n': 'a'}, {'n': 'b'}] | join(',', attribute='n') }}", {}),
    ("{{ '<b>' | e }} {{ '<b>' | safe }}", {}),
    # tests
    ("{{ x is defined }} {{ y is undefined }} {{ none is none }} {{ 'a' is string }} {{ 1 is number }} "
     "{{ true is number }} {{ 1 is integer }} {{ true is integer }} {{ 1.0 is float }} {{ {} is mapping }} "
     "{{ [] is iterable }} {{ 'x' is iterable }} {{ y is iterable }} {{ 1 is iterable }} {{ 'a' is sequence }} "
     "{{ true is boolean }} {{ false is false }} {{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} "
     "{{ 2 is in [1, 2] }} {{ 1 is eq 1 }} {{ 2 is gt 1 }} {{ 'ab' is lower }} {{ x is not none }}", {"x": 1}),
    # statements
    ("{% for x in [] %}x{% else %}empty{% endfor %} {% for x in [1, 2] %}{{ x }}{% else %}no{% endfor %}", {}),
    ("{% for i in range(10) %}{% if i == 2 %}{% continue %}{% elif i > 5 %}{% break %}{% endif %}{{ i }}"
     "{% endfor %} {{ range(3) | list }} {{ range(1, 10, 3) | list }} {{ range(5, 0, -2) | list }}", {}),
    ("{% for m in messages %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}"
     "{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.cycle('a', 'b') }}"
     "{{ loop.previtem.role if loop.previtem is defined }}{{ loop.nextitem is defined }};{% endfor %}",
     {"messages": MSGS}),
    ("{% for m in messages if m.role == 'user' %}{{ loop.index }}/{{ loop.length }}:{{ m.content }};{% endfor %}",
     {"messages": MSGS}),
    ("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}{{ v }}{% endfor %} {% for a, b in [[1, 2], [3, 4]] %}"
     "{{ a * b }}{% endfor %} {% for (a, b) in [(1, 2)] %}{{ a }}{{ b }}{% endfor %}", {}),
    ("{% set x = 1 %}{% for i in [1, 2] %}{% set x = x + i %}{{ x }}{% endfor %}{{ x }}", {}),
    ("{% set ns = namespace(x=1, l=[]) %}{% for i in [1, 2, 3] %}{% set ns.x = ns.x * i %}"
     "{% set ns.l = ns.l + [i] %}{% endfor %}{{ ns.x }} {{ ns.l }}", {}),
    ("{% set a, b = 1, 2 %}{{ a }}{{ b }} {% set t = (1, 2) %}{{ t }} {% set c = [1, 2] %}{{ c[0] }}", {}),
    ("{% set block %}\n  inner {{ 1 + 1 }}\n{% endset %}[{{ block }}] {% set up | upper %}shout{% endset %}{{ up }}", {}),
    ("{% macro greet(name, punct='!') %}Hello {{ name }}{{ punct }}{% endmacro %}{{ greet('a') }} "
     "{{ greet('b', '?') }} {{ greet(punct='.', name='c') }}", {}),
    ("{% macro fact(n) %}{{ 1 if n <= 1 else n * fact(n - 1) | int }}{% endmacro %}{{ fact(5) }}", {}),
    ("{% filter upper %}shout {{ 'this' }}{% endfilter %} {% with a = 1, b = 2 %}{{ a + b }}{% endwith %}", {}),
    ("{% if x %}a{% elif y %}b{% elif z %}c{% else %}d{% endif %}", {"x": 0, "y": "", "z": [1]}),
    ("{{ messages[0]['content'] }} {{ messages[-1].content }} {{ messages | length }} {{ messages[1:] | length }}",
     {"messages": MSGS}),
    ("{% for m in messages %}{% if m['role'] == 'user' %}{{ '<u>' + m['content'] | trim + '</u>' }}{% endif %}"
     "{% endfor %}", {"messages": MSGS}),
    ("{{ raise_exception('custom failure') }}", {}),
    ("{{ x.y }}", {}),
    ("{{ x.y.z }}", {"x": {}}),
    ("{{ 1 + 'a' }}", {}),
    ("{{ 'a' + 1 }}", {}),
    ("{{ 1 / 0 }}", {}),
    ("{{ [1, 2].append(3) }}", {}),
    ("{{ messages[9].content }}", {"messages": MSGS}),
    ("{{ none.content }}|{{ x.content }}|", {"x": None}),
    ("{{ (messages | selectattr('role', 'eq', 'nobody') | first).content }}", {"messages": MSGS}),
    ("{{ foo(1) }}", {}),
    ("{{ 1 | nosuchfilter }}", {}),
    ("{{ 1 is nosuchtest }}", {}),
    ("{% for x in 5 %}{% endfor %}", {}),
]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/tokenizer/data/jinja_cases.jsonl"
    with open(out, "w", encoding="utf-8") as f:
        for tmpl, ctx in CASES:
            row = {"template": tmpl, "context": ctx}
            try:
                row["output"] = ENV.from_string(tmpl).render(**ctx)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{out}: {len(CASES)} cases (jinja2 {jinja2.__version__})", file=sys.stderr)


if __name__ == "__main__":
    main()
