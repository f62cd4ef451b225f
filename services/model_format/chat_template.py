"""A checkpoint's own chat template, rendered in a Jinja sandbox exactly as transformers renders it.

The template comes from `chat_template.jinja` next to the tokenizer, else from `chat_template` in
`tokenizer_config.json` (transformers' order). Rendering uses the same environment as transformers
(`ImmutableSandboxedEnvironment`, `trim_blocks`, `lstrip_blocks`, `raise_exception`, `tojson`,
`strftime_now`, `{% generation %}`) and the same variables (`messages`, `add_generation_prompt`,
`tools`, `documents` and the tokenizer's named special tokens), so the text is transformers' text.

User strings can carry a control token's text (`<|im_end|>` typed into a message). `mark_control_tokens`
wraps such text in private-use markers before rendering, and `split_marked` lets the tokenizer encode
what was marked as plain text: only the tokens the template itself writes become control ids. This is
transformers' `apply_chat_template(..., sanitize_control_tokens=True)`, and for content without control
tokens it changes nothing.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE_FILE = "chat_template.jinja"

# The template of the synthetic checkpoints, and of any checkpoint that ships none.
CHAT_TEMPLATE_JINJA = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# transformers' markers (Supplementary Private Use Area-A): never produced by a tokenizer's vocabulary
# on purpose, and stripped from user strings before marking so they cannot be forged.
CONTROL_START = "\U000f0000"
CONTROL_END = "\U000f0001"

_MIN_JINJA = (3, 1, 6)  # older versions have known sandbox escapes; templates are untrusted code


class ChatTemplateError(ValueError):
    """A chat template that does not compile, or that refused to render a conversation.

    The message quotes the template's own words (e.g. what it passed to `raise_exception`).
    """


def read_chat_template(directory: Path, tokenizer_config: Mapping[str, Any]) -> tuple[str, str] | None:
    """`(source, origin)` of the checkpoint's template, or None when it ships none.

    `chat_template.jinja` wins over `tokenizer_config.json`, as in transformers. A config may hold one
    template (a string) or named ones (`[{"name": ..., "template": ...}]` or a dict): "default" is used.
    """
    # Origins name the file, not its path: they reach API clients in error messages.
    file = directory / CHAT_TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8"), CHAT_TEMPLATE_FILE
    value = tokenizer_config.get("chat_template")
    origin = "tokenizer_config.json chat_template"
    if value is None:
        return None
    if isinstance(value, str):
        return value, origin
    named: dict[str, Any] = {}
    if isinstance(value, list):
        for item in value:
            if isinstance(item, Mapping) and isinstance(item.get("name"), str):
                named[item["name"]] = item.get("template")
    elif isinstance(value, Mapping):
        named = dict(value)
    default = named.get("default")
    if isinstance(default, str):
        return default, f"{origin}['default']"
    raise ChatTemplateError(
        f"{origin} must be a string or named templates with a 'default', got {_short(value)!r}"
        + (f" (names {sorted(named)})" if named else "")
    )


class ChatTemplate:
    """One compiled template plus the special-token variables it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str], origin: str = "chat template") -> None:
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens)
        self._template = _compile(source, origin)

    @functools.cached_property
    def literal_text(self) -> str:
        """Every string the template writes literally, joined by NULs (so a search cannot span two)."""
        ast = _environment().parse(self.source)
        literals = {node.data for node in ast.find_all(jinja2.nodes.TemplateData)}
        literals |= {node.value for node in ast.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
        return "\0".join(sorted(literals))

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The conversation as text, as `tokenizer.apply_chat_template(..., tokenize=False)` writes it."""
        # transformers drops None-valued keys: templates test for presence, and "None" must not be written.
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(
                messages=chat,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template ({self.origin}) refused the conversation: {e.message}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(
                f"the chat template ({self.origin}) failed on the conversation: {type(e).__name__}: {e}"
            ) from e


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@functools.lru_cache(maxsize=32)
def _compile(source: str, origin: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template ({origin}) does not compile: line {e.lineno}: {e.message}") from e


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates want plain JSON (as in transformers).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # A `dict` global without attribute access to the type (transformers' TemplateDict).
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    # Namespaces that refuse underscore names, so templates cannot reach CPython internals through them.
    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own signature trick: `self` may be a key
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    version = tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < _MIN_JINJA:
        raise ImportError(f"chat templates need jinja2>=3.1.6 (sandbox fixes), found {jinja2.__version__}")
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


# ---- control tokens in user strings ---------------------------------------------------------------


def control_token_pattern(tokens: Iterable[str]) -> re.Pattern[str]:
    """A regex matching any of `tokens`, longest first (so a token wins over the tokens inside it)."""
    longest_first = sorted(set(tokens), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")


def marker_pattern(tokens: Iterable[str]) -> re.Pattern[str]:
    """A regex matching a marked token (captured) or a lone marker; `re.split` then alternates text and tokens."""
    inner = control_token_pattern(tokens).pattern
    return re.compile(f"{CONTROL_START}({inner}){CONTROL_END}|[{CONTROL_START}{CONTROL_END}]")


def mark_control_tokens(obj: Any, pattern: re.Pattern[str]) -> Any:
    """Wrap every control token in the strings of `obj` (recursively; dict keys excluded) in markers."""
    if isinstance(obj, str):
        obj = obj.replace(CONTROL_START, "").replace(CONTROL_END, "")
        return pattern.sub(f"{CONTROL_START}\\g<0>{CONTROL_END}", obj)
    if isinstance(obj, Mapping):
        return {key: mark_control_tokens(value, pattern) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [mark_control_tokens(value, pattern) for value in obj]
    return obj
