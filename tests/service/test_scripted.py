"""The scripted (oracle) drafter as a unit: plans, continuation bookkeeping, catch-up ingestion."""
from __future__ import annotations

import numpy as np
import pytest

from specd.draft_worker.scripted import ScriptedDrafter

PROMPT = (1, 2, 3)
CONT = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]


def drafter(plan):
    d = ScriptedDrafter(4, 100, {PROMPT: CONT}, plan)
    d.ingest("s", 0, PROMPT, np.zeros((3, 2), np.float32))
    return d


@pytest.mark.parametrize("plan,want", [
    (None, [11, 12, 13, 14]), (0, [12, 13, 14, 15]), (2, [11, 12, 14, 15]), (-1, []),
    ({1, 3}, [11, 13, 13, 15]), ([0], [12, 12, 13, 14]),
])
def test_plans(plan, want):
    d = drafter(plan)
    assert d.propose("s", 10, 4) == want  # anchor CONT[0] at position 3; drafts predict CONT[1..4]


def test_follows_committed_tokens_and_runs_out_of_continuation():
    d = drafter(None)
    d.propose("s", 10, 4)
    d.ingest("s", 3, [10, 11, 12], np.ones((3, 2), np.float32))  # anchor + 2 accepted committed
    assert d.propose("s", 13, 2) == [14, 15]
    d.ingest("s", 6, [13, 14, 15, 16, 17, 18], np.ones((6, 2), np.float32))
    assert d.propose("s", 19, 3) == [1, 1, 1]  # past the continuation: wrong tokens (0 + 1)
    with pytest.raises(ValueError):
        d.ingest("s", 5, [1], np.ones((1, 2), np.float32))  # gap / overlap is an error
    assert sorted(d.seen["s"]) == list(range(12))
    assert d.release("s") and not d.live()
