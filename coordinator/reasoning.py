"""Reasoning budget (spec-loop.md §10): count thinking tokens and force the close of the thinking
section when the budget is spent, without giving up speculation.

A token is a *thinking token* when it is generated while a thinking section is open (``<think>`` seen
in the prompt or the output and ``</think>`` not since); ``<think>`` / ``</think>`` themselves do not
count. With budget B, once B thinking tokens have been emitted and the section is still open, the
next tokens are the **close sequence** instead of the model's (default: the tokenization of
``"\\n</think>\\n\\n"``, what a Qwen3.5 model writes when it closes by itself, so the answer starts
in the usual context; configurable with ``--reasoning-close``, it must contain ``</think>``). The
model's greedy output is thereby defined as: greedy until B thinking tokens, then the close
sequence, then greedy again — also when the model's own next token would have been ``</think>``.

How the loop uses it (server.py ``_loop``):

* :meth:`room` caps the drafts of the next step to the thinking tokens left (``B - count``), so a
  step emits at most ``B - count + 1`` tokens and only its last token — the bonus, which the target
  has *not* been fed (it is the next anchor) — can overflow the budget. Speculation runs to the edge.
* :meth:`apply` then replaces that overflowing bonus by the first close token: it becomes the anchor,
  is emitted and is fed to the target by the next Verify like any anchor (and ingested by the
  drafter with the committed tokens). So a one-token close costs no extra step at all.
* Each further close token needs one plain step (``room() == 0``): ``Verify([anchor])`` commits the
  anchor, its bonus is replaced by the next close token. Speculation resumes after the last one.
* Outside a thinking section a step may open one: :meth:`clip` cuts the drafts before the first one
  that would pass the budget (e.g. drafts after a drafted ``<think>`` once the budget is spent), and a
  plain run (several plain steps in one call) is capped at ``room() + 1`` steps inside a section and
  stops right after a ``<think>`` outside one (:attr:`run_stop`), so in every case only the step's
  last token can overflow.
"""
from __future__ import annotations


class BudgetError(RuntimeError):
    """The verify emitted more tokens past the budget than the clipped step allows (a bug)."""


class ReasoningBudget:
    """Thinking-section tracker and forcer for one request.

    Args:
        budget: thinking tokens allowed (>= 1 when armed; 0 = only count, never force).
        open_id / close_id: ids of ``<think>`` / ``</think>``.
        close_seq: forced ids (contains ``close_id``).
        in_think: the prompt leaves a thinking section open.
    """

    def __init__(self, budget: int, open_id: int, close_id: int, close_seq: list[int], in_think: bool):
        self.budget, self.open_id, self.close_id = int(budget), int(open_id), int(close_id)
        self.close_seq = [int(t) for t in close_seq]
        self.in_think = bool(in_think)
        self.count = 0            # thinking tokens emitted
        self.queue: list[int] = []  # close tokens still to force
        self.closed = False       # the budget forced a close
        self.forced = 0

    @staticmethod
    def prompt_in_think(prompt, open_id: int, close_id: int) -> bool:
        """True when the prompt's last ``<think>`` comes after its last ``</think>``."""
        last_open = last_close = -1
        for i, t in enumerate(prompt):
            if t == open_id:
                last_open = i
            elif t == close_id:
                last_close = i
        return last_open > last_close

    @property
    def armed(self) -> bool:
        return self.budget > 0

    def room(self) -> int | None:
        """Most drafts the next step may verify (None: no limit from the budget)."""
        if not self.armed:
            return None
        if self.queue:
            return 0
        if self.in_think:
            return max(0, self.budget - self.count)
        return None

    @property
    def run_stop(self) -> int | None:
        """Token after which a plain run must end (``<think>`` while armed, so the run cannot open a
        section and go past the budget inside it), or None."""
        return self.open_id if self.armed else None

    def clip(self, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` in which no token would be emitted past the budget (the
        budget simulated over the drafts from the current state): accepted drafts then never overflow,
        only the bonus may. All of them when not armed."""
        if not self.armed:
            return drafts
        sim = ReasoningBudget(self.budget, self.open_id, self.close_id, self.close_seq, self.in_think)
        sim.count, sim.queue = self.count, list(self.queue)
        for i, t in enumerate(drafts):
            if sim._over():
                return drafts[:i]
            sim.track(int(t))
        return drafts

    def _over(self) -> bool:
        return self.armed and (bool(self.queue) or (self.in_think and self.count >= self.budget))

    def apply(self, emitted: list[int]) -> list[int]:
        """The step's emitted tokens with a forced close token in place of an overflowing bonus
        (only the last token may be replaced); updates the counts."""
        return [self.take(t, i == len(emitted) - 1) for i, t in enumerate(emitted)]

    def take(self, t: int, last: bool) -> int:
        """One emitted token, in order: the token itself (counted), or, when it is past the budget,
        the next forced close token in its place. Raises BudgetError when a token that is not the
        step's ``last`` is past the budget (the step was not clipped: a bug). The loop takes a
        step's tokens one by one up to its finish, so tokens after a stop are never counted."""
        if self._over():
            if not last:
                raise BudgetError("reasoning budget: a token before the step's last was emitted past the budget")
            if not self.queue:
                self.queue = list(self.close_seq)
                self.closed = True
            t = self.queue.pop(0)
            self.forced += 1
            if t == self.close_id:
                self.in_think = False
            return t
        self.track(int(t))
        return int(t)

    def track(self, t: int) -> None:
        if t == self.close_id:
            self.in_think = False
        elif t == self.open_id:
            self.in_think = True
        elif self.in_think:
            self.count += 1
