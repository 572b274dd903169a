"""DDTree (spec-loop.md §7): the best-first build and the walk (unit), the target worker's tree
Verify / Commit over gRPC, and acceptance through non-chain branches end to end with the scripted
drafter whose per-position top-k puts the right token at chosen ranks (accepted-per-position and
accepted-per-rank stats asserted); every stream equals the plain greedy run."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from specd.coordinator.ddtree import auto_top_k, build_tree, walk_tree
from specd.draft_worker import server as dserver
from specd.draft_worker.scripted import ScriptedDrafter
from specd.protos.v1 import generate_pb2 as gpb
from specd.protos.v1 import worker_pb2 as wpb
from specd.protos.v1 import worker_pb2_grpc as wpbg

from .conftest import BLOCK, generate, streamed_ids, token_request

# ---------------------------------------------------------------------------- unit: build / walk

LP = [[-0.1, -1.0, -2.0], [-0.2, -0.8, -3.0], [-0.3, -0.5, -4.0]]
IDS = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]


def test_chain_seed_inserts_the_top1_chain_first():
    t = build_tree(1, IDS, LP, budget=2)
    assert t.tokens == [1, 10, 20] and t.parents == [-1, 0, 1] and t.rank == [-1, 0, 0]
    t = build_tree(1, IDS, LP, budget=5)
    # chain (3) then the best siblings: d3 r1 (-0.3 - 0.5 = -0.8), d2 r1 (-0.1 - 0.8 = -0.9)
    assert t.tokens == [1, 10, 20, 30, 31, 21] and t.parents == [-1, 0, 1, 2, 2, 1]
    assert t.depth == [0, 1, 2, 3, 3, 2] and t.rank == [-1, 0, 0, 0, 1, 1]
    np.testing.assert_allclose(t.score, [0, -0.1, -0.3, -0.6, -0.8, -0.9])


def test_budget_12_and_no_chain_seed():
    t = build_tree(1, IDS, LP, budget=12)
    assert t.n_nodes == 12 and t.tokens[:4] == [1, 10, 20, 30]
    # scores are non-increasing after the seeded chain, and every path is a real (depth, rank) path
    assert all(a >= b - 1e-6 for a, b in zip(t.score[4:], t.score[5:]))
    for i in range(1, len(t.tokens)):
        assert t.tokens[i] == IDS[t.depth[i] - 1][t.rank[i]]
        assert t.depth[i] == t.depth[t.parents[i]] + 1
    u = build_tree(1, IDS, LP, budget=12, chain_seed=False)
    assert u.tokens[:4] == [1, 10, 20, 30] and u.n_nodes == 12  # the chain is also the best-first start

    def paths(tr):  # the node set as root-to-node token paths (row numbering may differ)
        out = set()
        for i in range(1, len(tr.tokens)):
            p, j = [], i
            while j > 0:
                p.append(tr.tokens[j])
                j = tr.parents[j]
            out.add(tuple(p[::-1]))
        return out

    assert paths(u) == paths(t)


def test_duplicate_children_are_skipped_and_limits():
    ids = [[5, 5, 6], [7, 8, 9]]  # a duplicate candidate in row 0
    t = build_tree(0, ids, [[-0.1, -0.2, -0.3], [-0.1, -0.2, -0.3]], budget=20)
    kids = [t.tokens[i] for i in range(1, len(t.tokens)) if t.parents[i] == 0]
    assert sorted(kids) == [5, 6]  # 5 once
    assert t.n_nodes == 2 + 2 * 3
    assert build_tree(3, [], [], budget=4).tokens == [3]
    with pytest.raises(ValueError):
        build_tree(0, IDS, LP, budget=0)
    with pytest.raises(ValueError):
        build_tree(0, [[1, 2], [3]], [[0, 0], [0]], budget=3)
    assert auto_top_k(12, 6, 100) == 8 and auto_top_k(5, 6, 100) == 1 and auto_top_k(12, 6, 4) == 4


def test_walk_follows_the_argmax_child():
    tokens, parents = [1, 10, 20, 30, 31, 21], [-1, 0, 1, 2, 2, 1]
    assert walk_tree(tokens, parents, [10, 21, 0, 0, 0, 0]) == [0, 1, 5]  # a sibling branch at depth 2
    assert walk_tree(tokens, parents, [10, 20, 31, 0, 0, 0]) == [0, 1, 2, 4]
    assert walk_tree(tokens, parents, [10, 20, 31, 0, 0, 0], max_accept=1) == [0, 1]
    assert walk_tree(tokens, parents, [99] * 6) == [0]
    with pytest.raises(ValueError):
        walk_tree([1, 2], [0, 0], [0, 0])


# ---------------------------------------------------------------------------- target worker tree verify


def test_target_tree_verify_commits_the_walked_path(stack, reference, plain_model):
    prompt = [3, 1, 4, 1, 5]
    ref, _ = reference(prompt, 8)
    wrong = lambda t: (t + 1) % plain_model.hp.n_vocab  # noqa: E731
    # root = ref[0]; depth 1: wrong, right; depth 2 under the right one: right, wrong
    tokens = [ref[0], wrong(ref[1]), ref[1], ref[2], wrong(ref[2])]
    parents = [-1, 0, 0, 2, 2]
    with grpc.insecure_channel(f"unix://{stack.dir}/t.sock") as ch:
        stub = wpbg.TargetWorkerStub(ch)
        pre = stub.Prefill(wpb.PrefillRequest(seq_id="tree-a", tokens=prompt, capacity=40), timeout=30)
        assert pre.first_token == ref[0]
        try:
            r = stub.Verify(wpb.VerifyRequest(seq_id="tree-a", tokens=tokens, parents=parents), timeout=30)
            assert list(r.path) == [0, 2, 3] and r.accepted == 2
            assert list(r.emitted) == ref[1:4] and r.committed == len(prompt) + 3
            assert len(r.argmax) == 5 and r.argmax[0] == ref[1] and r.argmax[3] == ref[3]
            # deferred tree commit: Commit with the path
            t2 = [ref[3], wrong(ref[4]), ref[4]]
            r = stub.Verify(wpb.VerifyRequest(seq_id="tree-a", tokens=t2, parents=[-1, 0, 0], defer_commit=True),
                            timeout=30)
            assert list(r.path) == [0, 2] and list(r.emitted) == ref[4:6]
            with pytest.raises(grpc.RpcError) as e:
                stub.Commit(wpb.CommitRequest(seq_id="tree-a", n=2), timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as e:  # not a root path
                stub.Commit(wpb.CommitRequest(seq_id="tree-a", path=[1, 2]), timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert stub.Commit(wpb.CommitRequest(seq_id="tree-a", path=[0, 2]), timeout=30).committed == len(prompt) + 5
            # the state after the tree commits equals the plain run: the next chain step continues it
            r = stub.Verify(wpb.VerifyRequest(seq_id="tree-a", tokens=[ref[5], ref[6]]), timeout=30)
            assert list(r.emitted) == ref[6:8]
            for bad in ([0, 0, 0], [-1, 1, 0], [-1, 0]):
                with pytest.raises(grpc.RpcError) as e:
                    stub.Verify(wpb.VerifyRequest(seq_id="tree-a", tokens=[1, 2, 3], parents=bad), timeout=30)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "parents" in e.value.details()
        finally:
            stub.Release(wpb.ReleaseRequest(seq_id="tree-a"), timeout=10)


# ---------------------------------------------------------------------------- end to end, scripted top-k


@pytest.fixture(scope="module")
def tree_stack(stack):
    """A scripted drafter worker whose top-k follows ``drafter.topk_ranks``, with its coordinator."""
    d = ScriptedDrafter(BLOCK, stack.tservicer.model.hp.n_vocab)
    svc = dserver.DraftServicer(d)
    addr = f"unix://{stack.dir}/d-tree.sock"
    srv, _ = dserver.start_server(svc, addr, 8)
    try:
        yield stack.coordinator(drafter_override=addr), d
    finally:
        srv.stop(0).wait()
        svc.close()


PROMPTS = [[7, 7, 2], [100, 3, 250, 9, 1, 4], [11]]
ABSENT = (None,) * BLOCK  # deeper positions: the right token is not among the candidates


def tree_run(stub, d, reference, prompt, ranks, max_tokens=20, **spec):
    ref, _ = reference(prompt, max_tokens + BLOCK + 2)
    d.continuations[tuple(prompt)] = ref
    d.topk_ranks = ranks
    sp = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE, draft_mode=gpb.DRAFT_MODE_TREE, **spec)
    chunks, done = generate(stub, token_request(prompt, max_tokens, ignore_eos=True, speculation=sp))
    assert streamed_ids(chunks) == ref[:max_tokens], (prompt, ranks, spec)
    return done.speculation


@pytest.mark.parametrize("chain_seed", [True, False])
def test_acceptance_through_a_rank1_branch(tree_stack, reference, chain_seed):
    """Right token at rank 1 for position 1 and rank 0 for position 2, nothing deeper: the chain is
    wrong at depth 1, the rank-1 sibling and its rank-0 child are in a 12-node tree, so every step
    accepts 2 (1 when the depth is 1) — through a non-chain branch."""
    stub, d = tree_stack
    for prompt in PROMPTS:
        sp = tree_run(stub, d, reference, prompt, (1, 0) + ABSENT, tree_budget=12, tree_top_k=4, tree_chain_seed=chain_seed)
        n = sp.num_drafts
        assert n > 0 and sp.num_tree_steps == n
        pos = list(sp.accepted_per_position)
        assert pos[0] == n and pos[1] in (n, n - 1) and not any(pos[2:]), pos
        assert list(sp.accepted_per_rank) == [pos[1], n]
        assert sp.num_accepted_tokens == pos[0] + pos[1]


def test_acceptance_through_a_deeper_branch(tree_stack, reference):
    """Ranks (0, 1, 0): right on the chain at depth 1, on the rank-1 sibling at depth 2, then its
    rank-0 child: 3 accepted per full-depth step, ranks 0, 1, 0."""
    stub, d = tree_stack
    for prompt in PROMPTS:
        sp = tree_run(stub, d, reference, prompt, (0, 1, 0) + ABSENT, max_tokens=24, tree_budget=12, tree_top_k=3)
        n = sp.num_drafts
        pos, rk = list(sp.accepted_per_position), list(sp.accepted_per_rank)
        assert pos[0] == n and pos[2] >= n - 2 and not any(pos[3:]), pos
        assert rk[1] == pos[1] and rk[0] == pos[0] + pos[2]


@pytest.mark.parametrize("budget", [2, 5])
def test_small_budgets_keep_only_the_chain(tree_stack, reference, budget):
    """Right token at rank 2 (depth 1), nothing deeper: a 2-node tree holds the seeded chain only and
    never accepts; a 5-node tree reaches the rank-2 candidate only when the depth is 1 (the last
    step), where chain + rank 1 + rank 2 fit. The output is exact either way."""
    stub, d = tree_stack
    for prompt in PROMPTS:
        sp = tree_run(stub, d, reference, prompt, (2,) + ABSENT, tree_budget=budget, tree_top_k=3)
        assert sp.num_drafts > 0 and sp.num_draft_tokens <= budget * sp.num_drafts
        if budget == 2:
            assert sp.num_accepted_tokens == 0
        else:
            assert sp.num_accepted_tokens <= 1
            if sp.num_accepted_tokens:
                assert list(sp.accepted_per_rank) == [0, 0, 1] and sp.accepted_per_position[0] == 1


def test_oracle_chain_in_tree_mode_and_budget_clipped(tree_stack, reference, stack):
    """The scripted oracle (every chain token right): tree mode accepts the whole chain (rank 0);
    a budget above max_verify - 1 is clipped, not refused."""
    stub, d = tree_stack
    prompt = PROMPTS[1]
    sp = tree_run(stub, d, reference, prompt, None, max_tokens=22, tree_budget=1000)
    assert sp.num_accepted_tokens == sum(sp.accepted_per_position) == sp.accepted_per_rank[0]
    assert len(sp.accepted_per_rank) == 1 and sp.accepted_per_position[0] == sp.num_drafts
    assert sp.mean_acceptance_length > 3


def test_tree_mode_needs_top_k(stack):
    """The session's scripted drafter reports max_top_k 8; a request above it is refused."""
    sp = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE, draft_mode=gpb.DRAFT_MODE_TREE, tree_top_k=9)
    with pytest.raises(grpc.RpcError) as e:
        generate(stack.stub, token_request([1, 2], 4, speculation=sp))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_top_k" in e.value.details()
    sp = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE, draft_mode=gpb.DRAFT_MODE_TREE, tree_budget=0)
    with pytest.raises(grpc.RpcError) as e:
        generate(stack.stub, token_request([1, 2], 4, speculation=sp))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tree_budget" in e.value.details()
