"""``specd generate``: a command-line client that streams a completion and prints stats.

Text goes to stdout as it arrives; with ``--ids`` the token ids are printed instead. At the end the
finish reason, usage and speculation stats go to stderr (``--json`` prints the final message as JSON
on stdout instead). Exit status: 0 on success, 1 with the gRPC status on stderr otherwise.
"""
from __future__ import annotations

import sys


def add_arguments(p) -> None:
    p.add_argument("--server", default="localhost:50051", help="coordinator address (default localhost:50051)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--chat", help="user message, rendered with the model's chat template")
    src.add_argument("--token-ids", help="comma-separated prompt token ids")
    p.add_argument("--system", default="", help="system message for --chat")
    p.add_argument("--max-tokens", type=non_negative_int, default=None,
                   help="completion budget (default: server default)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    p.add_argument("--include-stop", action="store_true", help="include the matched stop in the output")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    p.add_argument("--speculation", choices=["auto", "off", "force"], default="auto", help="mode (default auto)")
    p.add_argument("--max-draft-tokens", type=non_negative_int, default=None, help="cap on drafts per step")
    p.add_argument("--draft-mode", choices=["default", "chain", "tree"], default="default",
                   help="chain or tree (DDTree) drafting (default: the server's)")
    p.add_argument("--tree-budget", type=non_negative_int, default=None,
                   help="DDTree node budget (default: the server's)")
    p.add_argument("--tree-top-k", type=non_negative_int, default=None,
                   help="DDTree candidates per position (default: server)")
    p.add_argument("--no-tree-chain-seed", action="store_true", help="DDTree without the top-1 chain seed")
    p.add_argument("--confidence-threshold", type=float, default=None,
                   help="DSpark confidence gate in [0, 1), 0 = off (default: the server's)")
    p.add_argument("--dspark-markov", choices=["default", "fused", "unfused", "off"], default="default",
                   help="DSpark Markov mode: fused / unfused (bitwise identical) / off (argmax of the base "
                        "logits); default: the drafter worker's (--dspark-markov, default fused); "
                        "ignored by non-DSpark drafters")
    p.add_argument("--no-thinking", action="store_true",
                   help="--chat: render the template with enable_thinking=false (default: the template's)")
    p.add_argument("--thinking", action="store_true", help="--chat: render with enable_thinking=true")
    p.add_argument("--reasoning-budget", type=non_negative_int, default=None,
                   help="most thinking tokens before </think> is forced (0 = unmanaged; default: the server's)")
    p.add_argument("--request-id", default="", help="request id (default: server-assigned)")
    p.add_argument("--timeout-s", type=float, default=None, help="deadline in seconds (default none)")
    p.add_argument("--token-by-token", action="store_true", help="one chunk per token instead of per step")
    p.add_argument("--ids", action="store_true", help="print token ids instead of text")
    p.add_argument("--json", action="store_true", help="print the final message as JSON")


def non_negative_int(text: str) -> int:
    """argparse type of the options that land in uint32 request fields: an int in 0 .. 2^32 - 1
    (argparse names the option in its error)."""
    v = int(text)
    if not 0 <= v < 2**32:
        raise ValueError(text)
    return v


def build_request(args):
    from specd.protos.v1 import generate_pb2 as gpb

    req = gpb.GenerateRequest(request_id=args.request_id)
    if (args.no_thinking or args.thinking) and args.chat is None:
        raise ValueError("--thinking / --no-thinking need --chat")
    if args.prompt is not None:
        req.text = args.prompt
    elif args.chat is not None:
        if args.system:
            req.chat.messages.add(role="system", content=args.system)
        req.chat.messages.add(role="user", content=args.chat)
        if args.no_thinking or args.thinking:
            if args.no_thinking and args.thinking:
                raise ValueError("--thinking and --no-thinking exclude each other")
            req.chat.enable_thinking = args.thinking
    else:
        req.tokenized.input_ids.extend(int(x) for x in args.token_ids.split(",") if x.strip())
    if args.max_tokens is not None:
        req.stopping.max_tokens = args.max_tokens
    req.stopping.stop.extend(args.stop)
    req.stopping.stop_token_ids.extend(args.stop_token_id)
    req.stopping.include_stop = args.include_stop
    req.stopping.ignore_eos = args.ignore_eos
    req.speculation.mode = {"auto": gpb.SPECULATION_MODE_AUTO, "off": gpb.SPECULATION_MODE_OFF,
                            "force": gpb.SPECULATION_MODE_FORCE}[args.speculation]
    if args.max_draft_tokens is not None:
        req.speculation.max_draft_tokens = args.max_draft_tokens
    req.speculation.draft_mode = {"default": gpb.DRAFT_MODE_DEFAULT, "chain": gpb.DRAFT_MODE_CHAIN,
                                  "tree": gpb.DRAFT_MODE_TREE}[args.draft_mode]
    if args.tree_budget is not None:
        req.speculation.tree_budget = args.tree_budget
    if args.tree_top_k is not None:
        req.speculation.tree_top_k = args.tree_top_k
    if args.no_tree_chain_seed:
        req.speculation.tree_chain_seed = False
    if args.confidence_threshold is not None:
        req.speculation.confidence_threshold = args.confidence_threshold
    req.speculation.dspark_markov = {"default": gpb.DSPARK_MARKOV_DEFAULT, "fused": gpb.DSPARK_MARKOV_FUSED,
                                     "unfused": gpb.DSPARK_MARKOV_UNFUSED,
                                     "off": gpb.DSPARK_MARKOV_OFF}[getattr(args, "dspark_markov", "default")]
    if args.reasoning_budget is not None:
        if args.reasoning_budget < 0:
            raise ValueError("--reasoning-budget must be >= 0")
        req.reasoning_budget = args.reasoning_budget
    req.stream_options.token_by_token = args.token_by_token
    return req


def run(args) -> int:
    import grpc
    from google.protobuf import json_format

    from specd.protos.v1 import generate_pb2 as gpb
    from specd.protos.v1 import generate_pb2_grpc as gpbg

    req = build_request(args)
    with grpc.insecure_channel(args.server) as ch:
        stub = gpbg.SpecDecodeStub(ch)
        try:
            for r in stub.Generate(req, timeout=args.timeout_s):
                if r.HasField("chunk"):
                    if args.json:
                        continue
                    if args.ids:
                        if r.chunk.token_ids:
                            print(" ".join(str(t) for t in r.chunk.token_ids), end=" ", flush=True)
                    else:
                        sys.stdout.write(r.chunk.text)
                        sys.stdout.flush()
                else:
                    done = r.complete
        except grpc.RpcError as exc:
            print(f"\nspecd generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json_format.MessageToJson(done, preserving_proto_field_name=True))
        return 0
    sp = done.speculation
    print(file=sys.stderr)
    print(f"finish={done.finish_reason} prompt={done.usage.prompt_tokens} completion={done.usage.completion_tokens} "
          f"drafts={sp.num_drafts} draft_tokens={sp.num_draft_tokens} accepted={sp.num_accepted_tokens} "
          f"mean_acceptance_length={sp.mean_acceptance_length:.2f} plain_steps={sp.num_plain_steps} "
          f"switches={len(sp.policy_switches)} per_position={list(sp.accepted_per_position)}"
          + (f" dspark_markov={gpb.DSparkMarkov.Name(sp.dspark_markov)}" if sp.dspark_markov else ""), file=sys.stderr)
    if sp.thinking_tokens or sp.reasoning_budget_armed or any(s.reason == "budget" for s in sp.policy_switches):
        print(f"thinking_tokens={sp.thinking_tokens} budget_armed={sp.reasoning_budget_armed} "
              f"budget_closed={sp.reasoning_budget_closed} forced_tokens={sp.forced_tokens}", file=sys.stderr)
    t = done.timing
    print(f"ttft={t.ttft_s * 1e3:.1f}ms decode={t.decode_s * 1e3:.1f}ms steps={t.steps} "
          f"worker_compute={t.worker_compute_s * 1e3:.1f}ms loop_overhead={t.loop_overhead_s * 1e3:.1f}ms "
          f"({t.loop_overhead_s * 1e3 / max(1, t.steps):.2f} ms/step) target_compute={t.target_compute_s * 1e3:.1f}ms "
          f"draft_wait={t.draft_wait_s * 1e3:.1f}ms verify_wall={t.verify_wall_s * 1e3:.1f}ms "
          f"bookkeeping={t.bookkeeping_s * 1e3:.1f}ms target_handler={t.target_handler_s * 1e3:.1f}ms", file=sys.stderr)
    return 0
