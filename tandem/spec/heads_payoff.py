"""Whether a request's heads pay for themselves: ask them for a tree only while that beats not asking.

A heads round verifies the tree the heads drafted in the round before, and asks for the next
one: the target worker then runs the heads' drafting in the same batch step (on a 2-core CPU,
about a third of a target step: benchmarks/README.md, "Speculation heads on an Intel Xeon").
The tree pays in the tokens it adds. A weak head, or text it was not trained on, can make every
round dearer for less than it gives back: spec_bench measured the 47-minute CPU-trained EAGLE
head at 0.77x target-only on the Spec-Bench mix when asked every round, 0.97x with this check
(same run). A round that does not ask skips the drafting (the heads'
KV still takes the committed rows, so that asking again later needs no catch-up) and verifies
only the text's own repeat, when there is one.

So each request measures the two ways on its own rounds, as committed tokens per second of
round wall time (a decaying mean, so that it follows the text and the worker's load):

- ``heads``: the round verified the heads' tree (the round before asked) and asked for the next;
- ``plain``: the round before asked for nothing, and so does this one.

A round that switches way is counted for neither: its cost and its gain belong to different
ways. The request starts with its heads; after ``WARMUP_ROUNDS`` measured heads rounds it tries
``PROBE_ROUNDS`` measured plain rounds, then goes the faster way, and tries the other one again
for ``PROBE_ROUNDS`` after every ``REPROBE_EVERY`` rounds. With a good head the probes cost a few
per cent of its gain; with a bad one the request runs at the plain rate, less the probes.

Output does not depend on any of this: every round is verified by the target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HEADS, PLAIN = "heads", "plain"
WARMUP_ROUNDS = 4  # measured heads rounds before the first plain probe
PROBE_ROUNDS = 3  # measured rounds of the other way per probe
REPROBE_EVERY = 32  # rounds the faster way runs between probes
DECAY = 0.7  # weight of a way's mean rate against its newest round


@dataclass(slots=True)
class HeadsPayoff:
    """Per request: ``ask()`` before a heads round, ``observe(...)`` after it."""

    rate: dict[str, float] = field(default_factory=dict)  # way -> committed tokens per second (decaying mean)
    measured: dict[str, int] = field(default_factory=lambda: {HEADS: 0, PLAIN: 0})  # rounds counted per way
    way: str = HEADS  # the way this round asks
    probing: bool = False  # the current way is a probe of the slower one
    left: int = WARMUP_ROUNDS  # measured rounds left before the next decision
    _last_asked: bool = True  # whether the round before asked the heads (the Prefill always does)

    def ask(self) -> bool:
        """Whether this round asks the heads for the next tree."""
        return self.way == HEADS

    def observe(self, tokens: int, seconds: float) -> None:
        """A round that ran ``ask()``'s way ended: the tokens it committed, its wall time."""
        asked = self.way == HEADS
        steady = self._last_asked == asked  # it verified what the same way drafted (or nothing, for plain)
        self._last_asked = asked
        if not steady or seconds <= 0:
            return
        way = self.way
        sample = tokens / seconds
        old = self.rate.get(way)
        self.rate[way] = sample if old is None else DECAY * old + (1 - DECAY) * sample
        self.measured[way] += 1
        self.left -= 1
        if self.left == 0:
            self._settle() if self.probing else self._probe()

    def _faster(self) -> str:
        return HEADS if self.rate.get(HEADS, 0.0) >= self.rate.get(PLAIN, 0.0) else PLAIN

    def _probe(self) -> None:
        """Run the other way for a few measured rounds, its rate measured afresh (its old one is stale)."""
        self.way = PLAIN if self.way == HEADS else HEADS
        self.rate.pop(self.way, None)
        self.probing, self.left = True, PROBE_ROUNDS

    def _settle(self) -> None:
        """Take the faster way until the next probe."""
        self.way = self._faster()
        self.probing, self.left = False, REPROBE_EVERY
