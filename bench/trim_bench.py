#!/usr/bin/env python3
"""In-process timings of context trimming and token counting on the agent payloads.

- litellm.utils.trim_messages(messages, max_tokens=B)           (if litellm is installed)
- langchain_core.messages.trim_messages(strategy="last", include_system=True, ...)
  with an exact tiktoken cl100k counter and with token_counter="approximate"
  (if langchain-core is installed)
- raw tiktoken cl100k_base / o200k_base encoding of every message's text (the floor
  for counting tokens), and litellm.token_counter on the same messages

Each trimmed result is checked for tool-call pairing: every role=tool message must
sit in the block right after an assistant message that has a tool_call with that id,
and every tool_call must get its result. Times are medians over several runs.
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline: never fetch the cost map
from make_payloads import count_tokens, encoding, read_payload


def timed(fn, min_runs=3, max_runs=7, budget_s=20.0):
    """Median wall time of fn(); fewer runs when one run is slow."""
    times, out = [], None
    while len(times) < max_runs:
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= min_runs and sum(times) > budget_s:
            break
        if times[0] > budget_s:  # one very slow run is all we take
            break
    return statistics.median(times), len(times), out


def as_plain(msgs):
    """OpenAI dicts or LangChain messages -> list of (role, tool_call_ids, tool_call_id)."""
    out = []
    for m in msgs:
        if isinstance(m, dict):
            out.append((m["role"], [tc["id"] for tc in m.get("tool_calls") or []], m.get("tool_call_id")))
        else:
            role = {"human": "user", "ai": "assistant"}.get(m.type, m.type)
            out.append((role, [tc["id"] for tc in getattr(m, "tool_calls", None) or []],
                        getattr(m, "tool_call_id", None)))
    return out


def pairing_problems(msgs):
    probs, pending = [], None
    for i, (role, call_ids, result_id) in enumerate(as_plain(msgs)):
        if role == "tool":
            if pending is None or result_id not in pending:
                probs.append("orphan tool result at %d" % i)
            else:
                pending.discard(result_id)
            continue
        if pending:
            probs.append("%d tool_call(s) without result before %d" % (len(pending), i))
        pending = set(call_ids) if role == "assistant" and call_ids else None
    if pending:
        probs.append("%d tool_call(s) without result at end" % len(pending))
    return probs


def summarize(result, enc, budget, originals):
    dicts = result if not result or isinstance(result[0], dict) else lc_to_dicts(result)
    probs = pairing_problems(result)
    toks = count_tokens(dicts, enc)
    texts = {x for x in originals if isinstance(x, str)}
    cut = sum(isinstance(m.get("content"), str) and m["content"] != "" and m["content"] not in texts for m in dicts)
    return {"kept": len(dicts), "of": len(originals), "cut": cut, "tokens": toks, "within": toks <= budget,
            "system_kept": bool(dicts) and dicts[0]["role"] == "system",
            "pairing": "valid" if not probs else "BROKEN: %s%s" % (probs[0], " (+%d more)" % (len(probs) - 1)
                                                                   if len(probs) > 1 else "")}


def lc_to_dicts(msgs):
    from langchain_core.messages import convert_to_openai_messages
    return convert_to_openai_messages(msgs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--payloads", default="agent_long.json,agent_huge.json")
    ap.add_argument("--budgets", default="128000,16000")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    enc = encoding("cl100k_base")
    rows, floor = [], []

    try:
        import litellm
        from litellm.utils import trim_messages as litellm_trim
        litellm.suppress_debug_info = True
    except ImportError:
        litellm = None
        print("# litellm not installed: skipped", file=sys.stderr)
    try:
        from langchain_core.messages import BaseMessage, convert_to_messages
        from langchain_core.messages import trim_messages as lc_trim
    except ImportError:
        lc_trim = BaseMessage = None
        print("# langchain-core not installed: skipped", file=sys.stderr)

    # exact per-message count (the annotation tells LangChain so), same rule as count_tokens() + 4 per message
    def lc_counter(msg: BaseMessage):
        text = msg.content if isinstance(msg.content, str) else json.dumps(msg.content)
        n = 4 + len(enc.encode(text, disallowed_special=()))
        for tc in getattr(msg, "tool_calls", None) or []:
            n += len(enc.encode(tc["name"] + json.dumps(tc["args"]), disallowed_special=()))
        return n

    for pname in a.payloads.split(","):
        msgs = json.loads(read_payload(pname))["messages"]
        n_in, t_in = len(msgs), count_tokens(msgs, enc)
        originals = [m.get("content") for m in msgs]  # to spot messages whose text was cut
        print("# %s: %d messages, %d tokens (cl100k)" % (pname, n_in, t_in), file=sys.stderr)
        lc_msgs = convert_to_messages(msgs) if lc_trim else None
        for budget in [int(b) for b in a.budgets.split(",")]:
            cases = []
            if litellm:
                cases.append(("litellm trim_messages", lambda: litellm_trim(msgs, model="gpt-4o-mini",
                                                                              max_tokens=budget)))
            if lc_trim:
                kw = dict(max_tokens=budget, strategy="last", include_system=True)
                cases += [
                    ("langchain trim (tiktoken)", lambda: lc_trim(lc_msgs, token_counter=lc_counter, **kw)),
                    ("langchain trim (tiktoken, start_on=human)",
                     lambda: lc_trim(lc_msgs, token_counter=lc_counter, start_on="human", **kw)),
                    ("langchain trim (approximate, start_on=human)",
                     lambda: lc_trim(lc_msgs, token_counter="approximate", start_on="human", **kw)),
                ]
            for name, fn in cases:
                secs, runs, out = timed(fn)
                if isinstance(out, tuple):
                    out = out[0]
                row = dict(method=name, payload=pname, tokens_in=t_in, budget=budget, ms=secs * 1000, runs=runs,
                           **summarize(out, enc, budget, originals))
                rows.append(row)
                print("# %-44s %-15s budget=%6d %9.1f ms (n=%d) kept %d/%d msgs, %d tok, %s" % (
                    name, pname, budget, row["ms"], runs, row["kept"], n_in, row["tokens"], row["pairing"]),
                    file=sys.stderr)

    # the floor: tokenizing every message's text once (agent_huge)
    huge = json.loads(read_payload("agent_huge.json"))["messages"]
    texts = [m["content"] for m in huge if isinstance(m.get("content"), str)]
    texts += [tc["function"]["name"] + tc["function"]["arguments"] for m in huge for tc in m.get("tool_calls") or []]
    nbytes = sum(len(t.encode()) for t in texts)
    for ename in ("cl100k_base", "o200k_base"):
        e = encoding(ename)
        secs, runs, ntok = timed(lambda: sum(len(e.encode_ordinary(t)) for t in texts), min_runs=5)
        floor.append(dict(what="tiktoken %s encode, per message" % ename, ms=secs * 1000, runs=runs, tokens=ntok,
                          mb=nbytes / 1e6))
    if litellm:
        secs, runs, ntok = timed(lambda: litellm.token_counter(model="gpt-4o-mini", messages=huge), min_runs=5)
        floor.append(dict(what="litellm.token_counter(model=gpt-4o-mini)", ms=secs * 1000, runs=runs, tokens=ntok,
                          mb=nbytes / 1e6))

    print("\n| method | payload (tokens in) | budget | median ms (runs) | kept msgs | tokens out | "
          "within budget | texts cut | system kept | tool-call pairing |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %s (%d) | %d | %.1f (%d) | %d/%d | %d | %s | %d | %s | %s |" % (
            r["method"], r["payload"], r["tokens_in"], r["budget"], r["ms"], r["runs"], r["kept"], r["of"],
            r["tokens"], "yes" if r["within"] else "NO", r["cut"], "yes" if r["system_kept"] else "no", r["pairing"]))
    print("\nCounting floor on agent_huge.json (%d texts, %.2f MB):\n" % (len(texts), nbytes / 1e6))
    print("| what | median ms (runs) | tokens | M tokens/s |")
    print("|---|---|---|---|")
    for f in floor:
        print("| %s | %.1f (%d) | %d | %.2f |" % (f["what"], f["ms"], f["runs"], f["tokens"],
                                                f["tokens"] / f["ms"] / 1000))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"trim": rows, "floor": floor}, f, indent=1)


if __name__ == "__main__":
    main()
