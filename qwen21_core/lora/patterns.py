"""PEFT's per-layer overrides (`alpha_pattern` in a LoRA's metadata) matched against our layer names, safely.

PEFT reads each key as a regular expression that must match the end of a module name after a dot, or the whole
name (`(.*\\.)?(key)$`), the first matching key winning. A LoRA file is downloaded from strangers, so its keys never
reach Python's `re`: a backtracking engine on a key like `(.|.)*Q` runs for minutes while holding the interpreter
lock, which stops every thread of ComfyUI (its web server too). Keys here are read by a small matcher of our own:

- a key of letters, digits, `_`, `-` and dots (every key diffusers and PEFT write: module names) is compared as a
  fixed-length suffix, a dot matching any one character as it does in PEFT;
- any other key is parsed into a Thompson automaton (characters, `.`, classes, escapes like `\\d`, groups,
  alternation, `* + ?` and `{m,n}`), simulated one character at a time over all its states at once: time grows
  with name length times automaton size, never exponentially. Backreferences, lookaround, anchors inside a key and
  flags are refused, and the total work of one file's keys has a fixed budget: beyond it the file is refused.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

from ..errors import stable_name

MAX_KEY_CHARS = 256
MAX_KEYS = 10_000
MAX_STATES = 2_000  # automaton states of one key, after {m,n} is expanded
MAX_REPEAT = 100  # the largest m or n of {m,n}
MAX_NESTING = 32
WORK_BUDGET = 2_000_000  # automaton state visits for all keys of one file: well under a second

_PLAIN = frozenset(string.ascii_letters + string.digits + "_-.")
_DIGITS = frozenset(string.digits)
_WORD = frozenset(string.ascii_letters + string.digits + "_")
_SPACE = frozenset(" \t\n\r\f\v")
# A set of characters: (members, ranges (first, last), negated).
_ESCAPES = {"d": (_DIGITS, (), False), "D": (_DIGITS, (), True), "w": (_WORD, (), False),
            "W": (_WORD, (), True), "s": (_SPACE, (), False), "S": (_SPACE, (), True)}  # fmt: skip
_CONTROL = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
_ANY = (frozenset(), (), True)  # `.`: every character (layer names hold no newline)


@stable_name
class PatternError(ValueError):
    """A key this matcher does not read, or keys that need more work than the budget allows."""


class LayerPatterns:
    """The keys of one pattern dict, in their order; `find(layer)` is the key PEFT would pick, or None."""

    def __init__(self, keys: Iterable[str]):
        keys = list(keys)
        if len(keys) > MAX_KEYS:
            raise PatternError(f"{len(keys)} pattern keys (at most {MAX_KEYS})")
        self._work = _Budget(WORK_BUDGET)
        self._matchers = [(key, _compile(key)) for key in keys]
        self._found: dict[str, str | None] = {}

    def find(self, layer: str) -> str | None:
        if layer not in self._found:
            self._found[layer] = next((key for key, match in self._matchers if match(layer, self._work)), None)
        return self._found[layer]


class _Budget:
    def __init__(self, limit: int):
        self.left = limit

    def spend(self, count: int) -> None:
        self.left -= count
        if self.left < 0:
            raise PatternError(f"the pattern keys need more than {WORK_BUDGET} matching steps (too complex)")


def _compile(key: str):
    if not isinstance(key, str) or not key:
        raise PatternError(f"pattern key {key!r} is not a non-empty string")
    if len(key) > MAX_KEY_CHARS:
        raise PatternError(f"pattern key of {len(key)} characters (at most {MAX_KEY_CHARS})")
    if set(key) <= _PLAIN:
        return _suffix_matcher(key)
    return _Automaton(_Parser(key).parse()).matcher()


def _suffix_matcher(key: str):
    size = len(key)

    def match(layer: str, work: _Budget) -> bool:
        work.spend(1)
        if len(layer) < size or (len(layer) > size and layer[-size - 1] != "."):
            return False
        return all(k == "." or k == c for k, c in zip(key, layer[-size:], strict=True))

    return match


# ---- parsing: key -> a tree of ("chars", (members, ranges, negated)), ("seq", [...]), ("alt", [...]) and
# ("repeat", node, m, n or None)


class _Parser:
    def __init__(self, key: str):
        self.key, self.at, self.depth = key, 0, 0

    def fail(self, what: str) -> PatternError:
        return PatternError(f"pattern key {self.key!r}: {what} at character {self.at + 1} is not supported")

    def peek(self) -> str | None:
        return self.key[self.at] if self.at < len(self.key) else None

    def take(self) -> str:
        char = self.key[self.at]
        self.at += 1
        return char

    def parse(self):
        key = self.key
        if key.endswith("$") and not key.endswith("\\$"):  # redundant: the match is anchored at the end anyway
            self.key = key = key[:-1]
        node = self.alternation()
        if self.at != len(key):
            raise self.fail(f"an unmatched {key[self.at]!r}")
        return node

    def alternation(self):
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise self.fail(f"nesting deeper than {MAX_NESTING}")
        options = [self.sequence()]
        while self.peek() == "|":
            self.take()
            options.append(self.sequence())
        self.depth -= 1
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.quantified(self.atom()))
        return ("seq", items)

    def atom(self):
        char = self.take()
        if char == "(":
            if self.key.startswith("?:", self.at):
                self.at += 2
            elif self.peek() == "?":
                raise self.fail("a group flag, lookaround or named group")
            node = self.alternation()
            if self.peek() != ")":
                raise self.fail("an unclosed group")
            self.take()
            return node
        if char == "[":
            return ("chars", self.char_class())
        if char == ".":
            return ("chars", _ANY)
        if char == "\\":
            return ("chars", self.escape())
        if char in "*+?{":
            self.at -= 1
            raise self.fail(f"a quantifier {char!r} with nothing before it")
        if char in "^$":
            self.at -= 1
            raise self.fail(f"an anchor {char!r}")
        return ("chars", (frozenset(char), (), False))

    def escape(self):
        if self.peek() is None:
            raise self.fail("a trailing backslash")
        char = self.take()
        if char in _ESCAPES:
            return _ESCAPES[char]
        if char in _CONTROL:
            return frozenset(_CONTROL[char]), (), False
        if char.isalnum():
            self.at -= 1
            raise self.fail(f"the escape \\{char}")
        return frozenset(char), (), False

    def char_class(self):
        negated = self.peek() == "^"
        if negated:
            self.take()
        chars: set[str] = set()
        ranges: list[tuple[str, str]] = []
        first = True
        while True:
            char = self.peek()
            if char is None:
                raise self.fail("an unclosed [")
            if char == "]" and not first:
                self.take()
                return frozenset(chars), tuple(ranges), negated
            first = False
            self.take()
            if char == "\\":
                members, _, inverted = self.escape()
                if inverted:
                    raise self.fail("a negated escape inside [...]")
                chars |= members
                continue
            if self.peek() == "-" and self.key[self.at + 1 : self.at + 2] not in ("", "]"):
                self.take()
                end = self.take()
                if end == "\\" or end < char:
                    raise self.fail(f"the range {char}-{end}")
                ranges.append((char, end))
            else:
                chars.add(char)

    def quantified(self, node):
        while self.peek() in ("*", "+", "?", "{"):
            char = self.take()
            if char == "*":
                node = ("repeat", node, 0, None)
            elif char == "+":
                node = ("repeat", node, 1, None)
            elif char == "?":
                node = ("repeat", node, 0, 1)
            else:
                low, high = self.counts()
                node = ("repeat", node, low, high)
            if self.peek() == "?":  # lazy: the same language, so the same answer
                self.take()
        return node

    def counts(self) -> tuple[int, int | None]:
        end = self.key.find("}", self.at)
        if end < 0:
            raise self.fail("a { without }")
        body, self.at = self.key[self.at : end], end + 1
        low_text, comma, high_text = body.partition(",")
        try:
            low = int(low_text) if low_text else 0
            high = (int(high_text) if high_text else None) if comma else low
        except ValueError:
            raise self.fail(f"the repeat count {{{body}}}") from None
        if low > MAX_REPEAT or (high is not None and not low <= high <= MAX_REPEAT):
            raise self.fail(f"the repeat count {{{body}}} (counts up to {MAX_REPEAT})")
        return low, high


def _member(char: str, chars) -> bool:
    members, ranges, negated = chars
    inside = char in members or any(first <= char <= last for first, last in ranges)
    return inside != negated


# ---- the automaton: states are ("chars", (members, ranges, negated), next) | ("split", [targets]) | ("accept",)


class _Automaton:
    def __init__(self, tree):
        self.states: list = [("accept",)]
        self.start = self.build(tree, 0)

    def new(self, state) -> int:
        if len(self.states) >= MAX_STATES:
            raise PatternError(f"a pattern key needs more than {MAX_STATES} automaton states (too complex)")
        self.states.append(state)
        return len(self.states) - 1

    def build(self, node, after: int) -> int:
        """The state that matches `node` and then continues at `after`."""
        kind = node[0]
        if kind == "chars":
            return self.new(("chars", node[1], after))
        if kind == "seq":
            for item in reversed(node[1]):
                after = self.build(item, after)
            return after
        if kind == "alt":
            return self.new(("split", [self.build(option, after) for option in node[1]]))
        _, body, low, high = node
        if high is None:  # body{low,}: low copies, then a loop
            loop = self.new(("split", []))
            self.states[loop] = ("split", [self.build(body, loop), after])
            after = loop
        else:
            for _ in range(high - low):
                after = self.new(("split", [self.build(body, after), after]))
        for _ in range(low):
            after = self.build(body, after)
        return after

    def matcher(self):
        states, start = self.states, self.start

        def close(into: set, state: int, work: _Budget) -> None:
            stack = [state]
            while stack:
                state = stack.pop()
                if state in into:
                    continue
                into.add(state)
                work.spend(1)
                if states[state][0] == "split":
                    stack.extend(states[state][1])

        def match(layer: str, work: _Budget) -> bool:
            current: set[int] = set()
            for index, char in enumerate(layer):
                if index == 0 or layer[index - 1] == ".":  # the key may start here (PEFT: `(.*\.)?`)
                    close(current, start, work)
                following: set[int] = set()
                work.spend(len(current))
                for state in current:
                    entry = states[state]
                    if entry[0] == "chars" and _member(char, entry[1]):
                        close(following, entry[2], work)
                current = following
            return 0 in current

        return match
