"""`tandem generate --tools FILE`: functions the model may call, sent to a coordinator as the request's ToolOptions.

The file holds OpenAI's ``tools`` list (``{"type": "function", "function": {...}}`` items) or the functions alone
(``{"name", "description", "parameters"}``). Checked here as far as the file goes (readable, JSON, a list of
functions with names); the coordinator checks the rest (names, schemas, whether the chat template shows tools)
and names any bad field in its error.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.errors import InvalidRequestError

if TYPE_CHECKING:  # the gRPC stubs load when a request is made, not at every command's start
    from tandem.v1 import generation_pb2

CHOICES = ("auto", "none", "required")  # else the name of the one function to call


def add_tool_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tools", default=None, metavar="FILE",
                   help="with --addr: functions the model may call, a JSON file of OpenAI's tools list (or of the "
                        "functions alone). The prompt goes as a chat turn through the chat template, which shows "
                        "the model the tools; its calls come back parsed, printed after the text as one JSON "
                        "object a line (in --json: tool_calls)")
    p.add_argument("--tool-choice", default=None, metavar="auto|none|required|NAME",
                   help="with --tools: auto (the model decides, the default), none (no call), required (at least "
                        "one call), or a function's name (that call); required and a name are enforced with a "
                        "grammar")
    p.add_argument("--single-call", action="store_true",
                   help="with --tools: at most one call (OpenAI's parallel_tool_calls: false)")


def tool_options_from_args(args: argparse.Namespace) -> generation_pb2.ToolOptions | None:
    """The request's ToolOptions from ``--tools``, ``--tool-choice`` and ``--single-call``; None without tools."""
    if args.tools is None:
        if args.tool_choice is not None or args.single_call:
            raise InvalidRequestError("--tool-choice and --single-call need --tools")
        return None
    if not args.addr:
        raise InvalidRequestError("--tools: only with --addr (a coordinator renders the tools and parses the calls)")
    from tandem.v1 import generation_pb2
    options = generation_pb2.ToolOptions(tools=[_tool(i, item) for i, item in enumerate(_read(Path(args.tools)))],
                                         single_call=args.single_call)
    choice = args.tool_choice or "auto"
    if choice in CHOICES:
        options.choice = choice
    else:
        options.choice, options.function = "function", choice
    return options


def _read(path: Path) -> list[Any]:
    try:
        tools = json.loads(path.read_text())
    except OSError as exc:
        raise InvalidRequestError(f"--tools: cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise InvalidRequestError(f"--tools: {path} is not JSON ({exc})") from None
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError(f"--tools: {path} must hold a list of tools, got {type(tools).__name__}"
                                  + (" (empty)" if tools == [] else ""))
    return tools


def _tool(i: int, item: Any) -> generation_pb2.Tool:
    from tandem.v1 import generation_pb2

    if isinstance(item, dict) and "type" in item:
        if item["type"] != "function":
            raise InvalidRequestError(f"--tools[{i}].type: function tools only, got {item['type']!r}")
        item = item.get("function")
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        raise InvalidRequestError(f"--tools[{i}]: a function with a name, got {json.dumps(item)[:80]}")
    parameters = item.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequestError(f"--tools[{i}].parameters: a JSON schema (an object), got {json.dumps(parameters)}")
    return generation_pb2.Tool(name=item["name"], description=str(item.get("description") or ""),
                               parameters=json.dumps(parameters) if parameters is not None else "")
