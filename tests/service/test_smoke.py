from .conftest import generate, streamed_ids, token_request


def test_smoke(stack, reference):
    prompt = [5, 17, 33, 2, 90]
    ref, _ = reference(prompt, 20)
    stack.drafter.continuations[tuple(prompt)] = ref
    stack.drafter.plan = None
    chunks, done = generate(stack.stub, token_request(prompt, 12, ignore_eos=True))
    print(done)
    assert streamed_ids(chunks) == ref[:12]
