"""The arms `ridgefill eval` measures, by name (docs/method.md#measuring-a-release).

    exact, nofill, identity, ridgefill     the four arms of the method
    <fill>+<correction>...                 a fill arm (ridgefill or identity) with corrections: vscale, kscale,
                                           kshift (measured per request on the first tail rows), state (the
                                           release's terminal-state offsets, hybrids only)
    ridgefill+<selector>                   extra exact prefix rows: rows (the most-attended rows, inside the
                                           prefill), protected (prefix tokens in the release's protected-token
                                           table)
    ridgefill+<selector>:random | :tail    its equal-cost controls: the same number of rows, chosen at random
                                           among the filled rows, or added to the exact tail

A release's configuration (`formats.release.CONFIGURATIONS`: ridgefill, ridgefill+rows, ridgefill+kscale,
ridgefill+protected) is one of these arms, named canonically; eval measures it beside its default arms.

Corrections combine with each other and with a selector or control (`ridgefill+rows+vscale`). Modifiers may be
given in any order; an arm is named by its canonical spelling (base, then the corrections in the order above,
then the selector). Every selected-rows arm is measured with its two controls: eval adds them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ridgefill.errors import BadInput
from ridgefill.runtime.corrections import CORRECTIONS

BASES = ("exact", "nofill", "identity", "ridgefill")
SELECTORS = ("rows", "protected")
CONTROLS = ("random", "tail")


@dataclass(frozen=True)
class Arm:
    base: str
    corrections: tuple[str, ...] = ()
    selector: str | None = None
    control: str | None = None  # with a selector: which equal-cost control of it this arm is

    @property
    def name(self) -> str:
        parts = [self.base, *self.corrections]
        if self.selector:
            parts.append(self.selector + (f":{self.control}" if self.control else ""))
        return "+".join(parts)

    @property
    def selected(self) -> "Arm | None":
        """For a control, the selected-rows arm it matches in cost."""
        return Arm(self.base, self.corrections, self.selector) if self.control else None

    def controls(self) -> list["Arm"]:
        """For a selected-rows arm, its two controls."""
        if not self.selector or self.control:
            return []
        return [Arm(self.base, self.corrections, self.selector, c) for c in CONTROLS]


def parse_arm(text: str) -> Arm:
    """An arm from its name (modifiers in any order), or BadInput naming what is wrong."""
    base, *mods = str(text).strip().split("+")
    if base not in BASES:
        raise BadInput(f"unknown arm '{text}' (an arm is one of {', '.join(BASES)}, optionally with +modifiers)")
    fixes, selector, control = set(), None, None
    for m in mods:
        name, colon, ctl = m.partition(":")
        if name in CORRECTIONS and not colon:
            fixes.add(name)
        elif name in SELECTORS and (not colon or ctl in CONTROLS):
            if selector is not None:
                raise BadInput(f"arm '{text}': one selector per arm")
            selector, control = name, ctl or None
        else:
            raise BadInput(f"arm '{text}': unknown modifier '{m}' (corrections: {', '.join(CORRECTIONS)}; "
                           f"selectors: {', '.join(SELECTORS)}, each with :{' or :'.join(CONTROLS)} for a control)")
    if mods and base in ("exact", "nofill"):
        raise BadInput(f"arm '{text}': '{base}' takes no modifiers (they apply to the fill arms)")
    if selector and base != "ridgefill":
        raise BadInput(f"arm '{text}': row selectors apply to ridgefill")
    return Arm(base, tuple(c for c in CORRECTIONS if c in fixes), selector, control)


def plan(names) -> list[Arm]:
    """The arms to measure: as given (canonical, without duplicates), plus the controls of every selected-rows
    arm, each placed after it."""
    arms: list[Arm] = []
    for n in names:
        a = parse_arm(n)
        if a not in arms:
            arms.append(a)
    out: list[Arm] = []

    def add(a: Arm) -> None:
        if a in out:
            return
        if a.control:  # a control follows its selector, which brings both controls
            add(a.selected)
            return
        out.append(a)
        out.extend(c for c in a.controls() if c not in out)

    for a in arms:
        add(a)
    return out
