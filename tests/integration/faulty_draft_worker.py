"""A draft worker with a known losslessness defect put back, for tests that must catch it.

    python -m tests.integration.faulty_draft_worker [--fault MODE] <the arguments of `tandem serve draft`>

Two patches to ``tandem.rpc.distributions``, applied before the normal draft
server starts:

* a deliberately COARSE, distorting wire format: the wire carries sqrt(q)
  rounded to ``MANTISSA_BITS`` bits of mantissa, and decoding (unchanged)
  only renormalises, so q arrives flattened and coarse. Sent once this is
  still lossless: the draft samples from exactly what the target decodes.
  It exists to make the defect below large: every further encoding flattens
  q again. (Rounding alone would not do: quantising to a relative grid and
  renormalising is nearly idempotent, so a second encoding moves q by a
  fraction of a percent, as it does with the real float16 format, far below
  what a few thousand samples can see.)
* the defect (``--fault double-encoding``, the default): the draft samples
  from decode(encode(q)) but its reply carries encode(decode(encode(q))),
  so the target's acceptance test uses a q the token was not drawn from.

Meant for tiny vocabularies (the 6-token test models): over a real one,
the double encoding may drop a drawn token from the support, which the
target refuses as a malformed call rather than accepting wrongly.

``--fault coarse`` applies the coarse format alone: the control, which must
pass the statistical test that ``double-encoding`` fails.

Tests in process use ``install(monkeypatch.setattr, fault)``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

from tandem.rpc import distributions

# 2 bits of mantissa: values are 1, 1.25, 1.5, 1.75 times a power of two.
MANTISSA_BITS = 2
FAULTS = ("double-encoding", "coarse")

_original_encode_for_sampling = distributions.encode_for_sampling


def coarse_wire_values(values: torch.Tensor) -> torch.Tensor:
    """sqrt of each probability, rounded to ``MANTISSA_BITS`` bits of mantissa (to nearest), as float16."""
    mantissa, exponent = torch.frexp(values.sqrt())  # values = mantissa * 2**exponent, mantissa in [0.5, 1)
    scale = 2.0 ** (MANTISSA_BITS + 1)
    return torch.ldexp(torch.round(mantissa * scale) / scale, exponent).to(torch.float16)


def double_encoding(q: torch.Tensor) -> distributions.WireRows:
    """The defect: sample from decode(encode(q)), send encode(decode(encode(q)))."""
    once = _original_encode_for_sampling(q)
    twice = distributions.encode_distributions(once.dense())
    return distributions.WireRows(twice, once.token_ids, once.probs, once.vocab_size)


def install(setattr: Callable[[Any, str, Any], None] = setattr, fault: str = "double-encoding") -> None:
    """Patch ``tandem.rpc.distributions`` in this process (``setattr``: e.g. pytest's ``monkeypatch.setattr``)."""
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    setattr(distributions, "wire_values", coarse_wire_values)
    if fault == "double-encoding":
        setattr(distributions, "encode_for_sampling", double_encoding)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--fault", choices=FAULTS, default="double-encoding")
    args, serve_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    install(fault=args.fault)
    from tandem.cli import main as tandem_main

    return tandem_main(["serve", "draft", *serve_args])


if __name__ == "__main__":
    sys.exit(main())
