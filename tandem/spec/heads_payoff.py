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
round wall time (decayed sums of both, so that it follows the text and the worker's load):

- ``heads``: the round verified the heads' tree (the round before asked) and asked for the next;
- ``plain``: the round before asked for nothing, and so does this one (a plain round, or a ``hybrid``
  one with the draft model where ``auto`` found one beside the heads: ``SpecOptions.heads_fallback``).

A round that switches way is counted for neither: its cost and its gain belong to different
ways (nor is a hybrid round whose draft first reads what it missed). The request starts with the
way the recent requests of its generator or coordinator found faster (``HeadsVerdicts``; its heads
when none has settled yet); after ``WARMUP_ROUNDS`` measured rounds it tries ``PROBE_ROUNDS``
measured rounds of the other way, then goes the faster way, and tries the other one again for
``PROBE_ROUNDS`` after every ``REPROBE_EVERY`` rounds. With a good head the probes cost a few
per cent of its gain; with a bad one the request runs at the plain rate, less the probes.

Output does not depend on any of this: every round is verified by the target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HEADS, PLAIN = "heads", "plain"
WARMUP_ROUNDS = 4  # measured rounds of the way a request starts with, before the first probe of the other
PROBE_ROUNDS = 3  # measured rounds of the other way per probe
REPROBE_EVERY = 32  # rounds the faster way runs between probes
DECAY = 0.7  # weight of a way's earlier rounds against its newest one
VERDICT_MEMORY = 0.7  # weight of the earlier requests' verdicts against the newest one
FIRST_HEADS_SHARE = 0.6  # before any verdict: start with the heads


@dataclass(slots=True)
class HeadsVerdicts:
    """Which way the recent requests found faster, per fallback (plain, hybrid), shared by the requests of
    one generator or coordinator (one event loop: no lock). A request starts on it, so that heads that do
    not pay on a workload are not asked for the first rounds of every request (nor, beside a draft model,
    a draft's catch-up of each prompt paid to find it out again); its own rounds still probe the other."""

    heads_share: dict[str, float] = field(default_factory=dict)  # fallback -> decayed share of heads verdicts

    def start(self, fallback: str) -> str:
        return HEADS if self.heads_share.get(fallback, FIRST_HEADS_SHARE) >= 0.5 else PLAIN

    def record(self, fallback: str, faster: str) -> None:
        old = self.heads_share.get(fallback, FIRST_HEADS_SHARE)
        self.heads_share[fallback] = VERDICT_MEMORY * old + (1 - VERDICT_MEMORY) * (faster == HEADS)


@dataclass(slots=True)
class HeadsPayoff:
    """Per request: ``ask()`` before a heads round, ``observe(...)`` after it."""

    # way -> committed tokens per second: decayed tokens over decayed seconds (a ratio of sums, not a mean of
    # each round's ratio, which a lucky fast round lifts far more than a slow one lowers)
    rate: dict[str, float] = field(default_factory=dict)
    _sums: dict[str, tuple[float, float]] = field(default_factory=dict)  # way -> decayed (tokens, seconds)
    measured: dict[str, int] = field(default_factory=lambda: {HEADS: 0, PLAIN: 0})  # rounds counted per way
    way: str = HEADS  # the way this round asks (at construction: the way the request starts with)
    probing: bool = False  # the current way is a probe of the slower one
    left: int = WARMUP_ROUNDS  # measured rounds left before the next decision
    verdicts: HeadsVerdicts | None = None  # where each settled verdict goes, under ``fallback``
    fallback: str = "plain"
    _last_asked: bool = True  # whether the round before asked the heads (the Prefill always does)

    @classmethod
    def starting(cls, verdicts: HeadsVerdicts | None, fallback: str) -> HeadsPayoff:
        """A request's payoff, on the way ``verdicts`` say recent requests found faster (heads: none yet)."""
        way = verdicts.start(fallback) if verdicts is not None else HEADS
        return cls(way=way, verdicts=verdicts, fallback=fallback)

    def ask(self) -> bool:
        """Whether this round asks the heads for the next tree."""
        return self.way == HEADS

    def observe(self, tokens: int, seconds: float, catching_up: bool = False) -> None:
        """A round that ran ``ask()``'s way ended: the tokens it committed, its wall time. ``catching_up``:
        a draft model read what it missed in this round (the first hybrid round after heads rounds: the
        prompt or the rounds since it last drafted), a cost of switching, not the way's rate."""
        asked = self.way == HEADS
        steady = self._last_asked == asked  # it verified what the same way drafted (or nothing, for plain)
        self._last_asked = asked
        if not steady or catching_up or seconds <= 0:
            return
        way = self.way
        tokens_sum, seconds_sum = self._sums.get(way, (0.0, 0.0))
        tokens_sum, seconds_sum = DECAY * tokens_sum + tokens, DECAY * seconds_sum + seconds
        self._sums[way] = tokens_sum, seconds_sum
        self.rate[way] = tokens_sum / seconds_sum
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
        self._sums.pop(self.way, None)
        self.probing, self.left = True, PROBE_ROUNDS

    def _settle(self) -> None:
        """Take the faster way until the next probe."""
        self.way = self._faster()
        self.probing, self.left = False, REPROBE_EVERY
        if self.verdicts is not None:
            self.verdicts.record(self.fallback, self.way)
