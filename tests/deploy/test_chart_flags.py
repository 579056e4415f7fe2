"""Every flag the chart passes is one that `tandem serve <role>` takes, with a value it accepts.

The chart and the command line are written apart; this reads the real parser (no process, no
model) so that a renamed or mistyped flag fails here instead of in a crash-looping pod.
"""

from __future__ import annotations

import argparse

import pytest

from tests.deploy.chart import container, render, variant_names


def _role_parser(role: str) -> argparse.ArgumentParser:
    from tandem.cli import build_parser

    def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
        (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return subparsers.choices[name]

    return subcommand(subcommand(build_parser(), "serve"), role)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


@pytest.mark.parametrize("variant", [None, *variant_names()])
def test_every_flag_the_chart_passes_exists_with_an_accepted_value(variant):
    objects = render(variant)
    for component in ("coordinator", "target", "draft"):
        args = container(objects, component)["args"]
        role = component
        if component != "coordinator":  # the worker image's ENTRYPOINT is `tandem serve`: the role comes first
            role, args = args[0], args[1:]
            assert role == component
        known = _options(_role_parser(role))
        for i, token in enumerate(args):
            if not token.startswith("--"):
                continue
            action = known.get(token)
            assert action is not None, f"`tandem serve {role}` has no {token}"
            if action.nargs == 0:  # a switch such as --no-pipelining
                continue
            value = args[i + 1]
            if action.choices is not None:
                assert value in action.choices, f"{token} {value}: not one of {action.choices}"
            if action.type is not None:
                action.type(value)  # int("1.048576e+06") would raise here
