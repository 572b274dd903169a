"""Lossless speculative decoding with the target on the GPU: for every shipped demo drafter family
(DFlash, DFlash 2, DSpark; drafter worker on the CPU), chain and DDTree, the streamed ids of a
speculative generation equal plain greedy decoding of the same target on the GPU, token for token.

This holds only because the GPU verify is batch invariant (a row's logits do not depend on how many
rows share the verify: tests/gpu/test_gpu_target.py checks that bitwise); the drafters really propose
(held-out code prompts, acceptance > 1), so the verify widths vary from step to step. Skipped without
a GPU (``specd.native.gpu_available()``)."""
from __future__ import annotations

import pytest

import specd.native as sn
from specd.protos.v1 import generate_pb2 as gpb

from demo.test_demo_drafters import TARGET, demo_drafter_stack, plain_greedy, prompts
from service.conftest import generate, streamed_ids, token_request

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not sn.gpu_available(), reason="no GPU backend/device")]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def gpu_stack():
    with demo_drafter_stack(device="cuda") as stubs:
        yield {fam: stub for fam, (stub, _) in stubs.items()}


@pytest.fixture(scope="module")
def gpu_plain():
    if not TARGET.is_file():
        pytest.skip(f"{TARGET} not present")
    run = plain_greedy("cuda", MAX_TOKENS)
    return [run(text) for text in prompts("code", 2) + prompts("prose", 1)]


@pytest.mark.parametrize("mode", [gpb.DRAFT_MODE_CHAIN, gpb.DRAFT_MODE_TREE])
@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark"])
def test_gpu_spec_equals_gpu_plain(gpu_stack, gpu_plain, family, mode):
    accepted = 0
    for ids, ref in gpu_plain:
        sp = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE, draft_mode=mode)
        chunks, done = generate(gpu_stack[family], token_request(ids, MAX_TOKENS, ignore_eos=True, speculation=sp),
                                timeout=120)
        assert streamed_ids(chunks) == ref, (family, mode, ids[:8])
        accepted += done.speculation.num_accepted_tokens
    assert accepted > 0  # the drafts were really used


def test_gpu_plain_runs_equal_gpu_plain(gpu_stack, gpu_plain):
    """Speculation off with the target on the GPU: plain runs (up to 8 target steps per Verify call,
    each the one-row step of a single call) stream the same tokens as plain greedy decoding."""
    off = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_OFF)
    for ids, ref in gpu_plain:
        chunks, done = generate(gpu_stack["dflash"], token_request(ids, MAX_TOKENS, ignore_eos=True, speculation=off),
                                timeout=120)
        assert streamed_ids(chunks) == ref
        assert max(len(c.token_ids) for c in chunks) == 8 and done.speculation.num_plain_steps == MAX_TOKENS - 1
